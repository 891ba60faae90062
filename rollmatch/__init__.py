"""rollmatch: rollout-matching SFT for detection vision-language models.

The public Python API is re-exported from :mod:`rollmatch.api` (see docs/api.md). Importing the
package applies the environment workarounds of :mod:`rollmatch.models.compat` (only where needed),
so transformers, peft and vLLM import cleanly on CPU-only machines.
"""

from rollmatch.models.compat import apply_workarounds as _apply_workarounds

__version__ = "0.1.0"

_apply_workarounds()
