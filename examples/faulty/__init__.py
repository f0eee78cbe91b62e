"""Resources servers with one planted checkpointing bug each: the mutation test of `certify`.

NOT examples to copy. Each is the counter example (`examples/counter.py`) with one mistake a
user's own server could make, so that `rollout-checkpoint certify` has something real to find
(tests/test_certify_faulty.py asserts it finds each one, with the server, the check and the
first differing JSON path):

* `dropped_field`: the restore hook forgets a field the export writes (`history`);
* `restore_not_idempotent`: the restore hook adds the stored count to what the session holds;
* `background_mutation`: a task the runtime never sees changes session state;
* `hidden_state`: declared `stateless`, but its count is one number for the whole process;
* `side_effect_file`: every increment is also appended to a file outside the process, which
  `/verify` reads back.

Each is served as a user's own server is, `rollout-checkpoint serve
rollout_checkpoint.examples.faulty.<module>:<Class>`. `fleet.toml` beside them is ONE fleet
serving them all: the example environment, policy model and agent, and a resources member per
module named after it, `honest` (the counter they all start from, `honest.py`) among them as
the control; `tasks.jsonl` holds a few tasks per member, each row's `resources_server` naming
it. One certify run of that fleet finds every bug, and nothing at `honest`. They are not among
the example names `serve` offers, and the docs list none of them as an example to copy.
"""
