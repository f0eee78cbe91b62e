"""Whole checkpoints of a fleet, the fan-out beneath them, and where they are published.

* `checkpoint`: one whole checkpoint (prepare, commit, publish, resume, retention) in either
  mode, synchronous or asynchronous, and restoring a published one;
* `fanout`: each fleet operation on its own (prepare stage by stage, commit, resume, restore,
  retire, forget, renew), with the ordering and all-or-nothing rules over many members;
* `recording`: the record every checkpoint and restore attempt leaves in its root's history
  (`publication.history`), built from what the attempt already knows;
* `publication`: the checkpoint root (a directory or an object store): publishing a fleet
  checkpoint, `LATEST`, retention, the history, and verifying one independently.

`checkpoint` builds on `recording`, which builds on `fanout` and `publication`; `fanout`
knows nothing of publication.
The public names are listed by `rollout_checkpoint.client`.
"""
