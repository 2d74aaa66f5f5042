"""posttrain serve --engine vllm against vLLM's CUDA build, end to end (run by check-vllm-cuda.sh).

The same check as tests/serve/vllm/test_vllm_gateway.py's first test, on a GPU: for a tiny Qwen2
(untied, then tied), a chain full -> delta -> delta is written to a store folder, the gateway
(``python -m posttrain serve --engine vllm --engine-python <vLLM venv>``) hot-loads each snapshot
into the vLLM it starts, and vLLM's greedy tokens and logprobs are compared with transformers'
on the GPU. Prints PASS/FAIL per step; exits 1 on any failure.

Two roles:
  (project venv)  check_vllm_cuda.py --engine-python VENV/bin/python [--dtype float32] [--keep DIR]
  (vLLM venv)     check_vllm_cuda.py --reference MODEL_DIR [--dtype ...]: prints transformers'
                  greedy answers as JSON (CUDA torch lives in vLLM's venv, not the project's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[10, 20, 30], [5, 6, 7, 8, 9, 100, 200]]
MAX_TOKENS = 6
TOKEN = "gpu-check-token"
DEPLOYMENT = "dep-gpu-check"
PREFIX = "runs/r1"
NAME = "tiny"
TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}  # logprob tolerance by dtype


# ---------------------------------------------------------------------- reference role (vLLM's venv)
def reference(model_dir: str, dtype: str) -> None:
    """Greedy tokens and logprobs under transformers on CUDA (float64 softmax over the logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, toks, lps = list(prompt), [], []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids], device="cuda")).logits[0, -1]
                logp = torch.log_softmax(logits.double(), -1)
                t = int(torch.argmax(logp))
                toks.append(t)
                lps.append(float(logp[t]))
                ids.append(t)
            out.append([toks, lps])
    print(json.dumps(out))


# ---------------------------------------------------------------------- check role (project venv)
class Check:
    def __init__(self) -> None:
        self.failed = 0

    def step(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
        self.failed += not ok
        return ok


def perturbed(src: Path, dst: Path, seed: int, scale: float = 0.05) -> Path:
    """``src`` with every weight moved by Gaussian noise (as tests/support/vllm.py; ties kept)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(dst)
    for name in os.listdir(src):  # the tokenizer files
        if name.startswith(("tokenizer", "special_tokens")) and not (dst / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


def chain(root: Path, tied: bool) -> tuple[list[Path], list[str]]:
    from posttrain.chain.policy import ChainPolicy
    from posttrain.chain.writer import ChainWriter
    from posttrain.models.tiny import build_tiny_model

    # head_dim 32, as the CPU tests; float32 on disk (vLLM casts to --dtype)
    m0 = build_tiny_model(root / "m0", hidden_size=128, num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
    m1 = perturbed(m0, root / "m1", 1)
    m2 = perturbed(m1, root / "m2", 2)
    writer = ChainWriter(root / "store" / PREFIX, run="r1", policy=ChainPolicy(delta_budget=100.0))
    snaps = [writer.add(m0, step=0), writer.add(m1, base=m0, step=1), writer.add(m2, base=m1, step=2)]
    return [m0, m1, m2], [s.identity for s in snaps]


def start_gateway(m0: Path, root: Path, engine_python: Path, dtype: str) -> tuple[subprocess.Popen, str, Path]:
    log = root / "gateway.log"
    env = {**os.environ, "CW_API_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "posttrain", "serve", "--model", str(m0), "--served-model-name", NAME,
           "--port", "0", "--deployment-id", DEPLOYMENT, "--store", str(root / "store"), "--prefix", PREFIX,
           "--work-dir", str(root / "work"), "--engine", "vllm", "--engine-python", str(engine_python),
           "--engine-dtype", dtype, "--engine-max-model-len", "256", "--log-level", "info"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("posttrain serve:"):
                return proc, line.rsplit(" ", 1)[1], log
        if proc.poll() is not None:
            break
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"the gateway did not start; its log:\n{log.read_text(errors='replace')[-6000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served(url: str) -> tuple[list, str | None]:
    import requests

    out, identity = [], None
    for prompt in PROMPTS:
        body = {"model": NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
                "ignore_eos": True}
        r = requests.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=120)
        r.raise_for_status()
        reply = r.json()
        choice = reply["choices"][0]
        out.append([choice["token_ids"], choice["logprobs"]["token_logprobs"]])
        identity = reply["snapshot_identity"]
    return out, identity


def compare(got: list, want: list, tol: float) -> tuple[bool, str]:
    worst = 0.0
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        if gt != wt:
            return False, f"greedy tokens differ: {gt} != {wt}"
        worst = max([worst, *(abs(x - y) for x, y in zip(gl, wl, strict=True))])
    return worst <= tol, f"max |logprob diff| {worst:.2e} (tolerance {tol:g})"


def vllm_pids(gateway_pid: int) -> set[int]:
    """vLLM's processes: the process groups of the gateway's children."""
    from posttrain.serve.vllm.process import group_pids

    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if ppid == gateway_pid:
                found.update(group_pids(int(entry.name)))
    return found


def check_model(check: Check, root: Path, tied: bool, engine_python: Path, dtype: str) -> None:
    from posttrain.inference.config import HotLoadConfig
    from posttrain.inference.hotload import CoreWeaveHotLoader

    kind = "tied" if tied else "untied"
    models, ids = chain(root, tied)
    refs = []
    for m in models:
        run = subprocess.run([str(engine_python), __file__, "--reference", str(m), "--dtype", dtype],
                             capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                  if k not in ("PYTHONPATH", "PYTHONHOME")})
        if not check.step(f"{kind}: transformers reference on CUDA for {m.name}", run.returncode == 0,
                          run.stderr[-2000:] if run.returncode else ""):
            return
        refs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    if not check.step(f"{kind}: the three versions answer differently", refs[0] != refs[1] != refs[2]):
        return
    try:
        gateway, url, log = start_gateway(models[0], root, engine_python, dtype)
    except RuntimeError as e:
        check.step(f"{kind}: posttrain serve --engine vllm starts vLLM (CUDA)", False, str(e))
        return
    check.step(f"{kind}: posttrain serve --engine vllm starts vLLM (CUDA)", True, url)
    loader = CoreWeaveHotLoader(HotLoadConfig(api_url=url, deployment_id=DEPLOYMENT, token=TOKEN, timeout=900,
                                              poll_interval=0.2))
    try:
        got, _ = served(url)
        check.step(f"{kind}: boot weights served as transformers answers", *compare(got, refs[0], TOL[dtype]))
        for i, identity in enumerate(ids):
            step = f"{kind}: {'full' if i == 0 else 'delta'} {identity}"
            before = vllm_pids(gateway.pid)
            try:
                t0 = time.perf_counter()
                result = loader.hot_load(identity, base_identity=ids[i - 1] if i else None)
                secs = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - reported as this step's failure
                check.step(f"{step} hot-loads", False, f"{type(e).__name__}: {e}")
                break
            restarted = not (before & vllm_pids(gateway.pid))
            check.step(f"{step} hot-loads", result.identity == identity,
                       f"{secs:.1f} s, {'engine restarted' if restarted else 'reloaded in place'}")
            got, stamped = served(url)
            check.step(f"{step} stamps its answers", stamped == identity, f"snapshot_identity {stamped}")
            check.step(f"{step} served as transformers answers", *compare(got, refs[i], TOL[dtype]))
    finally:
        loader.close()
        engine_pids = vllm_pids(gateway.pid)
        stop(gateway)
    time.sleep(1)
    left = sorted(p for p in engine_pids if Path(f"/proc/{p}").exists())
    check.step(f"{kind}: the gateway's shutdown left no vLLM process", not left, str(left) if left else "")
    if check.failed:
        print(f"--- last lines of {log} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", metavar="MODEL_DIR", help="(vLLM venv) print transformers' greedy answers")
    ap.add_argument("--engine-python", type=Path, help="Python of the vLLM (CUDA) venv")
    ap.add_argument("--dtype", choices=sorted(TOL), default="float32", help="vLLM's --dtype and the reference's")
    ap.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder, removed)")
    args = ap.parse_args()
    if args.reference:
        reference(args.reference, args.dtype)
        return 0
    if args.engine_python is None or not args.engine_python.is_file():
        ap.error("--engine-python: the vLLM venv's python is required")
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = args.keep or Path(tempfile.mkdtemp(prefix="posttrain-vllm-cuda-"))
    check = Check()
    try:
        for tied in (False, True):
            check_model(check, root / ("tied" if tied else "untied"), tied, args.engine_python, args.dtype)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'FAIL' if check.failed else 'PASS'}: vLLM CUDA end-to-end check, {check.failed} step(s) failed")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
