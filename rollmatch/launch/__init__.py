"""``rollmatch launch``: rollout servers and the torchrun learner on disjoint devices, in one command.

- ``layout``: what the user asked for (:class:`~rollmatch.launch.layout.LaunchRequest`), every reason it
  cannot run (checked before anything starts) and the derived device layout. Pure.
- ``plan``: the launch config (servers left to the launcher), ports, hosts and the exact command and
  environment of every process, rendered for ``--dry-run``. Pure apart from reading the YAML.
- ``processes``: child processes in their own sessions, their logs and recorded pids, teardown.
- ``console``: the prefixed, rate-limited merge of the children's logs on the console.
- ``supervisor``: running a plan: start, wait for ``/health/``, watch, tear down, exit code.
- ``watchdog``: the process that stops every child tree when the launcher dies without its teardown.
- ``heartbeat``: node liveness across a multi-node launch (signed reports to node 0's hub).
- ``slurm``: the sbatch script of ``--emit slurm`` (resources, requeue on the warning signal).
- ``command``: the CLI entry (``rollmatch launch``).
"""
