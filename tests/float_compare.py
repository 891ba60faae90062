"""Comparing float32 results that are equal up to floating-point reassociation.

Two computations of the same quantity with different shapes (a packed row vs separate forwards, a
batch vs one sample) run through CPU kernels (ATen, oneDNN, MKL) that split their reductions by
shape and by instruction set, so they agree only up to the order of additions, and how closely
depends on the machine. A loss that is a *sum* over hundreds or thousands of tokens has a large
unit in the last place (2.4e-4 at 3,000 in fp32): an absolute tolerance such as 1e-5 holds on some
machines and fails on others. So such values are compared in units in the last place (ulps) of the
reference value. A module of its own (not ``conftest``) so tests anywhere under tests/ import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Reassociation moved per-segment loss sums by 0 or 1 ulp under every CPU kernel setting tried
# (docs/performance.md, "Exactness on other CPUs"); a real leak between segments moves them by
# 10,000 ulps and more. 16 leaves room for other kernels without hiding a leak.
REASSOCIATION_ULPS = 16


def ulps_apart(actual: torch.Tensor | float, reference: torch.Tensor | float) -> float:
    """``|actual - reference|`` in units in the last place of ``reference`` as a float32 number."""
    ref = float(reference.detach()) if isinstance(reference, torch.Tensor) else float(reference)
    got = float(actual.detach()) if isinstance(actual, torch.Tensor) else float(actual)
    return abs(got - ref) / float(np.spacing(np.float32(abs(ref))))


def assert_equal_up_to_reassociation(
    actual: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    what: str,
    ulps: float = REASSOCIATION_ULPS,
) -> None:
    """Each scalar within ``ulps`` units in the last place of its reference value."""
    found = [ulps_apart(a, b) for a, b in zip(actual, reference, strict=True)]
    values = [round(float(b), 3) for b in reference]
    assert max(found) <= ulps, f"{what} differences {found} ulps (values {values}; allowed {ulps})"
