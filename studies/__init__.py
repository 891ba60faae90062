"""The studies: programs that train arms of a training recipe and report a pre-registered verdict.

Each driver is a module run from the repository root, ``python -m studies.<name> ...`` (docs/runbook.md);
they share their statistics and protocols as modules of this package. Studies import ``rollmatch``;
``rollmatch`` never imports them, and the performance benches in ``bench/`` do not either.
"""

import rollmatch  # noqa: F401  (environment workarounds before transformers loads, for every study)
