"""fuse(model): a model's Conv -> BatchNorm (-> activation) sequences, found in its torch.fx graph, replaced by
the fused modules of convdsl/torch/fused.py (ConvBNAct, with ResNet's residual add when the block ends with one;
FusedBatchNorm where a BatchNorm followed by its activation has no convolution before it); original_names and
load_unfused_state_dict map the keys fuse() moved back to the unfused model's.
"""
from __future__ import annotations

import copy
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from .fused import _ACTIVATION_MODULES, _BATCH_NORMS, _FUSED_BATCH_NORMS, RESIDUAL_ACTIVATIONS, ConvBNAct
from .modules import _TORCH_BASES, _ConvMixin, _ConvTransposeMixin, convert

# activations as graph nodes call them (functions, and tensor methods by name)
_ACTIVATION_CALLS = {F.relu: "relu", torch.relu: "relu", F.relu6: "relu6", F.silu: "silu",
                     F.hardswish: "hardswish", "relu": "relu", "relu_": "relu"}


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _residual_add(node: Optional[fx.Node], operand: fx.Node) -> tuple[Optional[fx.Node], Optional[fx.Node], bool]:
    """(node, the other operand, in place) where node adds another tensor to `operand` (`out + r`, `out += r`,
    torch.add), else (None, None, False)."""
    if (node is None or node.op != "call_function" or node.kwargs or len(node.args) != 2
            or node.target not in (operator.add, operator.iadd, torch.add)):
        return None, None, False
    a, b = node.args
    other = b if a is operand else a if b is operand else None
    if not isinstance(other, fx.Node) or other is operand:
        return None, None, False
    # out += r changes out in place (the BatchNorm's output, which only the add uses); r += out would change r
    if node.target is operator.iadd and a is not operand:
        return None, None, False
    return node, other, node.target is operator.iadd


def _activation_of(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The activation a graph node applies to its one input, or None."""
    if node.op == "call_module":
        return _ACTIVATION_MODULES.get(type(modules.get(node.target)))
    if node.op in ("call_function", "call_method") and len(node.args) == 1:
        if node.kwargs and set(node.kwargs) != {"inplace"}:
            return None
        try:
            return _ACTIVATION_CALLS.get(node.target)
        except TypeError:  # an unhashable target
            return None
    return None


class _Tracer(fx.Tracer):
    """torch.fx's tracer with every convolution a leaf (convdsl's modules and torch.nn subclasses that live outside
    torch.nn, such as torchvision's video convolutions, would otherwise be traced through), and every module without
    a BatchNorm inside a leaf: no pattern can be inside it, and its forward stays its own Python (a trace would
    freeze branches on `self.training`, as torchvision's StochasticDepth takes)."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        if isinstance(m, _TORCH_BASES) or super().is_leaf_module(m, qualified_name):
            return True
        return not any(isinstance(d, nn.modules.batchnorm._BatchNorm) for d in m.modules())


def _traces(model: nn.Module) -> tuple[fx.Graph, fx.Graph]:
    """model's graphs traced in train and in eval mode (its mode restored)."""
    training = model.training
    try:
        graphs = []
        for mode in (True, False):
            model.train(mode)
            graphs.append(_Tracer().trace(model))
    finally:
        model.train(training)
    return graphs[0], graphs[1]


def fuse(model: nn.Module) -> fx.GraphModule:
    """`model` traced by torch.fx, its convolutions converted (convert()) and every convolution whose only use is a
    BatchNorm (whose only use may be an activation) replaced by a ConvBNAct holding the same modules: returns the
    GraphModule (parameters shared with `model`); a BatchNorm followed only by an activation (not after a
    convolution) becomes a FusedBatchNorm at its own path.  A fused convolution's parameters move under its ConvBNAct
    (`layer1.0.conv1.weight` -> `layer1.0.conv1.conv.weight`, `layer1.0.bn1.*` -> `layer1.0.conv1.bn.*`), as
    torch.ao.quantization.fuse_modules renames them.  A model torch.fx cannot trace gets a ValueError."""
    convert(model)
    try:
        train_graph, eval_graph = _traces(model)
    except Exception as e:  # torch.fx raises many types; the message names the construct it could not trace
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"fuse(): torch.fx cannot trace {type(model).__name__} ({first}); convert(model) runs its "
                         f"convolutions on convdsl unfused, or build ConvBNAct modules by hand") from e
    if str(train_graph) != str(eval_graph):  # the graph would keep one mode's branches
        raise ValueError(f"fuse(): {type(model).__name__}'s forward traces differently in train and eval mode "
                         f"(a branch on self.training in a module that holds a BatchNorm); convert(model) runs "
                         f"its convolutions on convdsl unfused, or build ConvBNAct modules by hand")
    gm = fx.GraphModule(model, train_graph if model.training else eval_graph, type(model).__name__)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for bn_node in list(gm.graph.nodes):
        bn = modules.get(bn_node.target) if bn_node.op == "call_module" else None
        if type(bn) not in _BATCH_NORMS.values() or len(bn_node.args) != 1 or bn_node.kwargs:
            continue
        conv_node = bn_node.args[0]
        if not isinstance(conv_node, fx.Node) or conv_node.op != "call_module" or len(conv_node.users) != 1:
            continue
        conv = modules.get(conv_node.target)
        if (not isinstance(conv, (_ConvMixin, _ConvTransposeMixin)) or calls[conv_node.target] != 1
                or calls[bn_node.target] != 1 or len(conv_node.args) != 1 or conv_node.kwargs
                or type(bn) is not _BATCH_NORMS[len(conv.kernel_size)] or bn.num_features != conv.out_channels):
            continue
        after = _only_user(bn_node)
        add_node, residual, inplace = _residual_add(after, bn_node)
        if add_node is not None:
            act_node = _only_user(add_node)
            activation = _activation_of(act_node, modules) if act_node is not None else None
            if activation not in RESIDUAL_ACTIVATIONS:  # its derivative would need the sum: the add stays out
                add_node = residual = None
        if add_node is None:
            act_node = after
            activation = _activation_of(act_node, modules) if act_node is not None else None
        fused = ConvBNAct(conv, bn, activation, residual_inplace=inplace)
        fused.unfused_names = (conv_node.target, bn_node.target)  # where the model kept them (original_names)
        gm.add_submodule(conv_node.target, fused)
        dropped = [n for n in (act_node if activation is not None else None, add_node, bn_node, conv_node) if n]
        # the fused call where the last of the nodes it replaces was: the residual may be computed after the
        # convolution (torchvision's downsample)
        with gm.graph.inserting_before(dropped[0]):
            fused_node = gm.graph.call_module(conv_node.target, (conv_node.args[0],)
                                              + (() if residual is None else (residual,)))
        dropped[0].replace_all_uses_with(fused_node)
        for node in dropped:
            gm.graph.erase_node(node)
        # the BatchNorm now lives in the ConvBNAct only (delete_all_unused_submodules would not see its old path:
        # named_modules lists a module once)
        gm.delete_submodule(bn_node.target)
    # a BatchNorm whose only use is an activation (not after a convolution: DenseNet's pre-activation layers after a
    # concatenation): a FusedBatchNorm sharing its parameters and buffers, at its path, computes both
    for bn_node in list(gm.graph.nodes):
        bn = modules.get(bn_node.target) if bn_node.op == "call_module" else None
        if (type(bn) not in _FUSED_BATCH_NORMS or calls[bn_node.target] != 1 or len(bn_node.args) != 1
                or bn_node.kwargs):
            continue
        act_node = _only_user(bn_node)
        activation = _activation_of(act_node, modules) if act_node is not None else None
        if activation is None:
            continue
        fused_bn = copy.copy(bn)  # the same parameter and buffer dicts; the model's own module keeps its class
        fused_bn.__class__ = _FUSED_BATCH_NORMS[type(bn)]
        fused_bn.fused_activation = activation
        gm.add_submodule(bn_node.target, fused_bn)
        act_node.replace_all_uses_with(bn_node)
        gm.graph.erase_node(act_node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def original_names(model: nn.Module) -> dict[str, str]:
    """For a model from fuse(): each state_dict key -> the key the unfused model had (`conv1.conv.weight` ->
    `conv1.weight`, `conv1.bn.running_mean` -> `bn1.running_mean`); keys fuse() did not move map to themselves."""
    moved: dict[str, str] = {}
    for path, m in model.named_modules():
        names = getattr(m, "unfused_names", None) if isinstance(m, ConvBNAct) else None
        if names is not None:
            moved[f"{path}.conv."] = f"{names[0]}."
            moved[f"{path}.bn."] = f"{names[1]}."
    result = {}
    for key in model.state_dict():
        prefix = next((p for p in moved if key.startswith(p)), None)
        result[key] = key if prefix is None else moved[prefix] + key[len(prefix):]
    return result


def load_unfused_state_dict(model: nn.Module, state_dict: dict, strict: bool = True):
    """Load a state_dict saved from the unfused model (a checkpoint from before fuse()) into the fused one."""
    renamed = {new: state_dict[old] for new, old in original_names(model).items() if old in state_dict}
    if strict:
        unexpected = set(state_dict) - set(original_names(model).values())
        if unexpected:
            raise KeyError(f"load_unfused_state_dict: keys the fused model has no place for: {sorted(unexpected)[:5]}")
    return model.load_state_dict(renamed, strict=strict)
