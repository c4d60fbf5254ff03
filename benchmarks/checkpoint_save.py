"""What a checkpoint save costs training, written in the background against written before
training goes on, side by side in one invocation (one node, 2 CPU processes, GPT-2 small: 124M
parameters, a 1.5 GB checkpoint with AdamW's state, on this machine's disk).

    python benchmarks/checkpoint_save.py                 # GPT-2 small, 8 steps, a save every 2
    python benchmarks/checkpoint_save.py --model gpt_smoke --iters 20 --save-every 5 --rounds 1

Each round trains the same run twice, ``training.async_save`` true and false (alternating which
goes first), and reads rank 0's own lines: each save's whole time and what training waited for
(``saved checkpoint at iteration N ... in S s (checksums C s of it; training waited W s)``), the
step times, and the time from the first step to the end. The last save of a run is waited for in
both modes and is left out of the waits. At the user's size a save's write is O(checkpoint / the
node's bandwidth): a Qwen3-32B checkpoint is 112 GB per node of 4 at about 1 GB/s, two minutes,
against a copy to host memory of seconds; here the disk is this machine's and the cores are shared
with the writer, so the step times beside a background write show that contention too.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import clean_env  # noqa: E402
from megatron_ext.run_spec.iteration_log import parse_log  # noqa: E402

SAVED = re.compile(r"saved checkpoint at iteration (\d+) to \S+ in ([\d.]+) s \(checksums ([\d.]+) s of it; "
                   r"training waited ([\d.]+) s\)")


def data_set(path: Path, iters: int, save_every: int, background: bool) -> str:
    path.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        f"training:\n  seq_length: 128\n  micro_batch_size: 1\n  global_batch_size: 2\n  train_iters: {iters}\n"
        f"  lr: 3.0e-4\n  min_lr: 3.0e-5\n  lr_warmup_iters: 1\n  eval_iters: 0\n  save_interval: {save_every}\n"
        f"  keep_checkpoints: 2\n  log_interval: 1\n  async_save: {str(background).lower()}\n")
    return str(path)


def one_run(model: str, iters: int, save_every: int, background: bool, root: Path) -> dict:
    run = f"save_{'bg' if background else 'sync'}_{time.monotonic_ns() % 10**6}"
    data = data_set(root / f"{run}.yaml", iters, save_every, background)
    env = clean_env(ARTIFACT_ROOT=str(root), NPROC_PER_NODE="2")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "orchestration", "train", model, data, run], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=3600)
    wall_s = time.monotonic() - started
    log = (root / "logs" / f"{run}_node0.log").read_text(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{run} failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}{log[-2000:]}")
    saves = [(int(i), float(s), float(c), float(w)) for i, s, c, w in SAVED.findall(log)]
    records, _ = parse_log(log)
    steps = [r.step_time_s for r in records if r.iteration > 1]
    not_last = [w for i, _, _, w in saves if i != iters]
    return {"mode": "background" if background else "before training goes on", "saves": len(saves),
            "save_s": statistics.mean(s for _, s, _, _ in saves), "waited_s": sum(not_last),
            "step_s": statistics.median(steps), "wall_s": wall_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        for r in range(args.rounds):
            for background in ((True, False) if r % 2 == 0 else (False, True)):
                rows.append(one_run(args.model, args.iters, args.save_every, background, Path(tmp)))
    print(f"{args.model}, {args.iters} steps, a save every {args.save_every}, 2 CPU processes; "
          f"waited: the saves but the last, summed")
    print(f"{'round':>5} | {'mode':<24} | {'saves':>5} | {'save s':>7} | {'waited s':>8} | {'step s':>6} | {'wall s':>6}")
    for n, row in enumerate(rows):
        print(f"{n // 2 + 1:>5} | {row['mode']:<24} | {row['saves']:>5} | {row['save_s']:>7.2f} | {row['waited_s']:>8.2f} "
              f"| {row['step_s']:>6.2f} | {row['wall_s']:>6.1f}")
    for mode in ("background", "before training goes on"):
        mine = [row for row in rows if row["mode"] == mode]
        print(f"{mode}: waited {statistics.mean(r['waited_s'] for r in mine):.2f} s, "
              f"wall {statistics.mean(r['wall_s'] for r in mine):.1f} s (mean of {len(mine)})")


if __name__ == "__main__":
    main()
