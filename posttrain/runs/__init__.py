"""Training runs on a cluster, seen from the submitting side: no Prefect, no torch.

- ``job``: one settings file (``cluster:`` + ``trainer:``) -> ``TrainingSettings`` -> the trainer as
  a cluster ``JobSpec``; and the results file its attempts append to;
- ``follow``: submit it (a ``TrainingRun``: this process's handle on the job) and follow it, job
  state then each complete checkpoint, in step order;
- ``watch``: hand out each complete checkpoint of an output folder once, with a cursor file;
- ``once``: submit at most once per marker file (a ``JobRecord``); from the record, after a restart
  too, say which checkpoints an earlier attempt handled, hand out those left, wait for the result;
- ``resident``: a run's job as a pipeline drives it, in one object (``RunJob``: checkpoints, result,
  cancel), and a GRPO run's resident trainer (``ResidentRun``: hand rounds, wait for their
  checkpoints, the policy a round samples under a staleness bound).
"""
