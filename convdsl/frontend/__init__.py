"""convdsl frontend: source text -> `ConvProblem`s.

    from convdsl.frontend import parse, parse_file, ConvSyntaxError
    problems = parse_file("examples/resnext.conv", batch=2)

See parser.py for the language and grammar.lark for its syntax.
"""
from convdsl.frontend.parser import (
    CONV_KEYS,
    KERNEL_KEYS,
    REQUIRED_CONV_KEYS,
    ConvSyntaxError,
    parse,
    parse_file,
)

__all__ = ["ConvSyntaxError", "parse", "parse_file", "CONV_KEYS", "KERNEL_KEYS", "REQUIRED_CONV_KEYS"]
