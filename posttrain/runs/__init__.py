"""Training runs on a cluster, seen from the submitting side: no Prefect, no torch.

- ``job``: one settings file (``cluster:`` + ``trainer:``) -> the trainer as a cluster job spec;
- ``follow``: submit it and follow it, job state then each complete checkpoint, in step order;
- ``watch``: hand out each complete checkpoint of an output folder once, with a cursor file;
- ``once``: submit at most once per marker file, find the job again after a restart, and say
  which checkpoints an earlier attempt already handled.
"""
