"""`rollout-checkpoint certify`: the user's own fleet run under fault injection, with proof.

    rollout-checkpoint certify --fleet fleet.toml --tasks tasks.jsonl \\
        [--trials 50] [--seed 1] [--report DIR] [--only N]

A baseline of every task runs uninterrupted, twice (at two concurrencies) with the policy
model recording then replaying; then N trials, each a fault at a phase drawn from the seed,
recovered through the product's own paths (the collector's in-place recovery, `collect
--resume`), and checked against the baseline by named invariants. One concept a module:

* `findings`: the checks, faults, phases, violations, trial results, matrix and summary;
* `plan`: which trials a seed makes;
* `observations`: what one run left behind, as the checks read it;
* `json_paths`: the first differing JSON path of two documents;
* `trajectories`: a rollout's trajectory, and whose code its first difference points at;
* `invariants`: the checks of one run against the baseline;
* `determinism`: the baseline against its second pass;
* `stateless_probe`: a `stateless` server's requests replayed on a fresh process;
* `setup`: what every run of one invocation shares (the fleet, the tasks, the tempo);
* `fleet_processes`: the fleet's members started, killed, stopped and replaced;
* `controller`: the collector as a process that pauses at a named step;
* `runs`: the collector's flags, and what a run left behind read back;
* `baseline`, `trial`: one run each; `strikes`: a trial's fault; `aftermath`: how the
  fleet reopened, what was restarted, whether every published checkpoint restores;
* `report`: the terminal table, `report.json` and `report.html`;
* `cli`: the argparse verb and its exit codes.
"""
