"""Channel-B's rollout sources beyond the step's own records, grouped so a reader finds them together.

Owns, one module per concern: ``step_mode`` (``stage2_ab.channel_b.mode: step``: a budget of rollouts
per optimizer step, trained to completion in that step), ``async_mode`` (``mode: async``: the learner
side of the async actor-learner, also its weight-sync policy), ``actor`` (the async rollout thread of
one rank), ``ready_packs`` (the version-pure packs and the bounded queue between actor and learner) and
``record_stream`` (which records the actor rolls out, and the ledger that makes resume exact).

Leaves out: Channel-B ``micro`` mode, which is the window's own records like Channel-A
(``training.channel_modes``), the segment producers (``training.segment_producers``) and the step
itself (``training.step``).
"""
