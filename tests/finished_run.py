"""What a finished training run left, for bit for bit comparisons (tests/chaos_run.py's runs): the newest complete
checkpoint's state and data positions and every step's logged loss and sample digest (`final_state`), what differs
between two (`differences`), and the same for a run made of legs on several topologies (`chain_state`)."""

import json

import numpy as np


def final_state(run_dir: str) -> dict:
    """What a finished run left: {"step", "state": {leaf name: array} of its newest complete checkpoint (params,
    optimizer state, step), "data_position": {file name: text} of each process, "losses": {step: loss} and
    "digests": {step: sample_digest}, from the last record of each step in metrics.jsonl}. Read with Orbax and the
    storage layer straight, not the trainer."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from clip_jax.runtime import storage
    from clip_jax.runtime.checkpoints import latest_complete_step

    checkpoints = storage.join(run_dir, "checkpoints")
    storage.prepare_for_orbax(checkpoints)
    step = latest_complete_step(checkpoints)
    state_dir = storage.join(checkpoints, str(step), "state")
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    leaves = {jax.tree_util.keystr(path): np.asarray(leaf)
              for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    data_dir = storage.join(checkpoints, str(step), "data_iter")
    position = {name: storage.read_text(storage.join(data_dir, name)) for name in storage.listdir(data_dir)
                if name != storage.COMMIT_FILE}
    losses, digests = {}, {}
    for line in storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        if "sample_digest" in record:
            digests[record["step"]] = record["sample_digest"]
    return {"step": step, "state": leaves, "data_position": position, "losses": losses, "digests": digests}


def chain_state(legs: list[tuple[int, dict]]) -> dict:
    """The `final_state` of a run made of legs, [(step the leg started from, its `final_state`)] in order, each leg
    resumed from the previous one's checkpoint at its start: the last leg's checkpoint, and each step's loss and
    digest from the leg that trained it (the latest to start before it)."""
    *_, (_, last) = legs
    losses, digests = {}, {}
    for (start, leg), (end, _) in zip(legs, legs[1:] + [(float("inf"), None)]):
        losses.update({s: loss for s, loss in leg["losses"].items() if start < s <= end})
        digests.update({s: digest for s, digest in leg["digests"].items() if start < s <= end})
    return {**last, "losses": losses, "digests": digests}


def stream_positions(data_position: dict) -> dict:
    """The data position of a run read as data streams, whatever the processes that saved it: {"data_streams",
    "streams": {stream: state}} merged from the processes' files (each holds the streams its process owned)."""
    merged, counts = {}, set()
    for text in data_position.values():
        saved = json.loads(text)
        merged.update(saved.get("streams", {}))
        counts.add(saved.get("data_streams"))
    return {"data_streams": sorted(counts, key=str), "streams": merged}


def differences(got: dict, expected: dict) -> list[str]:
    """What differs between two `final_state`s, bit for bit (empty: identical). The data positions are compared
    file by file when the same processes saved them, else stream by stream."""
    found = []
    if got["step"] != expected["step"]:
        found.append(f"final step {got['step']} != {expected['step']}")
    if got["state"].keys() != expected["state"].keys():
        found.append(f"state leaves differ: {sorted(got['state'].keys() ^ expected['state'].keys())}")
    for name in sorted(got["state"].keys() & expected["state"].keys()):
        a, b = got["state"][name], expected["state"][name]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            found.append(f"state {name} differs")
    if got["data_position"].keys() == expected["data_position"].keys():
        if got["data_position"] != expected["data_position"]:
            found.append(f"data position differs: {got['data_position']} != {expected['data_position']}")
    else:
        mine, theirs = stream_positions(got["data_position"]), stream_positions(expected["data_position"])
        if mine != theirs or not mine["streams"]:
            found.append(f"data position by stream differs: {mine} != {theirs}")
    for field, what in (("losses", "logged losses"), ("digests", "the steps' sample digests")):
        if got[field] != expected[field]:
            steps = sorted(s for s in got[field].keys() | expected[field].keys()
                           if got[field].get(s) != expected[field].get(s))
            found.append(f"{what} differ at steps {steps}")
    return found
