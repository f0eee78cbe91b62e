"""The `rollout-checkpoint` command line, one concept a module:

* `main`: the top-level parser and `main` (the console script); `serve` and `demo` exec the
  examples;
* `dispatch`: runs a parsed fleet verb (`health`, `inspect`, `coordinator` too);
* `console`: the one exit-code table, the one top-level error handler, the output layer;
* `names`: the wire's values as the CLI shows and parses them (states, health names, times,
  `--episode`);
* `parsers`: the fleet verbs' argument parsers and help (`health`, `inspect`, `coordinator`
  too);
* `errors`: how the client library's exceptions end a verb (exit code, one line);
* `fleet_verbs`: prepare, commit, checkpoint, restore, resume, retire, forget, renew, and the
  abort after a signal;
* `status`: `status` and `health`;
* `progress`: a prepare's live progress;
* `inspection`: `inspect`;
* `history_verb`: `history` (a root's checkpoint history);
* `coordinator_verb`: `coordinator`;
* `participant`: `participant RPC`.

`collect` is its own package (`rollout_checkpoint.client.collect`). This file imports nothing:
`main`'s rule (only the standard library and `stop_signals` before the signals are taken)
holds for the package it stands in.
"""
