"""rollmatch: rollout-matching SFT for detection vision-language models.

The public Python API is re-exported from :mod:`rollmatch.api` (see docs/api.md). Importing the
package arranges for the environment workarounds of :mod:`rollmatch.models.compat` (only where
needed) to apply before torchvision, transformers, peft or vLLM first load, so they import cleanly
on CPU-only machines; importing rollmatch itself stays light (no torch).
"""

from rollmatch.models.compat import apply_workarounds_on_import as _apply_workarounds_on_import

__version__ = "0.1.0"

_apply_workarounds_on_import()
