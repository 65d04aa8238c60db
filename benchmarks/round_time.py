"""CPU round time of the decoder at a given context length, this tree against an earlier
revision, side by side (the check that a layout change slows no arm down).

    python benchmarks/round_time.py --base d6354a4      # before/after, interleaved
    python benchmarks/round_time.py                      # this tree only

Random-weight pycode-small target + 1-layer DSpark drafter (γ = 7), R = 8 slots, every
slot active at ``--context`` committed tokens (default max_len − 16: the worst case for
attention that reads only up to each slot's length). For each arm it times the decoder's
own compiled plan + verify/commit (greedy) with exactly K drafts verified: ``none`` (no
drafter, the anchors only), K = R (one draft per slot), K = R·γ/2 and K = R·γ (``fixed``,
every draft). With ``--base`` the same measurement runs in a fresh process against a git
worktree of that revision (``PYTHONPATH``), alternating revisions ``--rounds`` times, and
the report gives each arm's median and the ratio this tree / base. It uses only the
decoder API both revisions share. Writes ``benchmarks/results/round_time.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def measure(args) -> dict[str, float]:
    """Median seconds per arm in this process (whichever dspark_jax it imports)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.models.drafters import DrafterConfig, init_drafter_params, make_drafter
    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.sched.sps import median_seconds

    cfg = get_preset(args.preset)
    r, g = args.slots, args.gamma
    target = Qwen3(cfg)
    tp = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    dcfg = DrafterConfig(kind="dspark", gamma=g, num_layers=1, mask_token_id=cfg.vocab_size - 1)
    drafter = make_drafter(dcfg, cfg)
    dp = nn.unbox(init_drafter_params(drafter, jax.random.key(1)))
    context = args.context if args.context is not None else args.max_len - 16

    def timed(dec, k):
        holder = [dec.init_state()]
        reset = dict(  # host arrays: fresh device copies each call (the state is donated)
            seq_len=np.full((r,), context, np.int32),
            active=np.ones((r,), bool),
            remaining=np.full((r,), args.max_len, np.int32),
        )
        fill = jnp.asarray(np.minimum(k // r + (np.arange(r) < k % r), g).astype(np.int32))

        def step():
            st = holder[0]._replace(**{n: jnp.asarray(v) for n, v in reset.items()})
            planned = dec.plan(st)
            if not hasattr(planned, "lengths"):  # (state, plan), since the paged drafter context
                st, planned = planned
            st, out = dec.commit(st, planned._replace(lengths=fill), k)
            holder[0] = st
            return out.tokens

        return median_seconds(step, args.repeats)

    out = {}
    plain = SpeculativeDecoder(target, tp, None, None, StepConfig(r, args.max_len, "none"))
    out["none K=0"] = timed(plain, 0)
    spec = SpeculativeDecoder(target, tp, drafter, dp, StepConfig(r, args.max_len, "fixed"))
    for k in (r, r * g // 2, r * g):
        out[f"dspark K={k}"] = timed(spec, k)
    return out


def _one_process(args, pythonpath: str | None) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--measure-to", path,
           "--preset", args.preset, "--slots", str(args.slots), "--gamma", str(args.gamma),
           "--max-len", str(args.max_len), "--repeats", str(args.repeats)]  # fmt: skip
    if args.context is not None:
        cmd += ["--context", str(args.context)]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run(cmd, check=True, env=env, cwd=pythonpath or REPO)
    with open(path) as f:
        res = json.load(f)
    os.unlink(path)
    package = res.pop("package")
    want = os.path.join(pythonpath or REPO, "dspark_jax")
    if os.path.realpath(package) != os.path.realpath(want):
        raise RuntimeError(f"measured {package}, not {want}: PYTHONPATH did not take effect")
    return res


def compare(args) -> dict:
    worktree = tempfile.mkdtemp(prefix="dspark_base_")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", worktree, args.base],
                   check=True, capture_output=True)  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    try:
        for i in range(args.rounds):
            for name, path in (("base", worktree), ("this", None)):
                print(f"[round_time] {name} ({i + 1} of {args.rounds})", flush=True)
                runs[name].append(_one_process(args, path))
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree],
                       check=False, capture_output=True)  # fmt: skip
    arms = list(runs["this"][0])
    med = {n: {a: statistics.median(run[a] for run in runs[n]) for a in arms} for n in runs}
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "command": "python benchmarks/round_time.py " + " ".join(sys.argv[1:]),
        "base": args.base,
        "this": head + ("+changes" if _dirty() else ""),
        "preset": args.preset,
        "slots": args.slots,
        "gamma": args.gamma,
        "max_len": args.max_len,
        "context": args.context if args.context is not None else args.max_len - 16,
        "runs": runs,
        "median_seconds": med,
        "ratio_this_over_base": {a: med["this"][a] / med["base"][a] for a in arms},
    }


def _dirty() -> bool:
    out = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                         capture_output=True, text=True).stdout  # fmt: skip
    return bool(out.strip())


def markdown(res: dict) -> str:
    lines = [
        f"# Round time on CPU, {res['this']} vs {res['base']} ({res['preset']}, R = "
        f"{res['slots']}, γ = {res['gamma']}, max_len = {res['max_len']}, every slot at "
        f"{res['context']} tokens)",
        "",
        f"Produced by `{res['command']}`: medians over {len(res['runs']['this'])} "
        "alternating processes per revision.",
        "",
        "| arm | base ms | this ms | this / base |",
        "|---|---|---|---|",
    ]
    for arm, ratio in res["ratio_this_over_base"].items():
        b, t = res["median_seconds"]["base"][arm], res["median_seconds"]["this"][arm]
        lines.append(f"| {arm} | {1e3 * b:.2f} | {1e3 * t:.2f} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=3, help="processes per revision")
    p.add_argument("--preset", default="pycode-small")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--context", type=int, default=None, help="tokens per slot (max_len - 16)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--measure-to", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "round_time"))
    args = p.parse_args(argv)
    if args.measure_to:
        import dspark_jax

        with open(args.measure_to, "w") as f:
            json.dump({"package": os.path.dirname(dspark_jax.__file__), **measure(args)}, f)
        return 0
    if args.base is None:
        print(json.dumps(measure(args), indent=2))
        return 0
    res = compare(args)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
