"""The tuning database: knob sets (Knobs) over a kernel's lowering, and the table of tuned ones shipped with
convdsl (db.json, read by the compile driver).  The search that fills the table is `convdsl tune`
(convdsl/tune.py)."""
from .knobs import Knobs

__all__ = ["Knobs"]
