"""The GPU check script (benchmarks/gpu/check.sh): its dry run on this CPU, and its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import report
from benchmarks.gpu.common import random_model
from benchmarks.gpu.learner_step import eager_attention
from online_sao.algorithms import build_critic
from online_sao.config import AlgorithmConfig

REPO = Path(__file__).resolve().parents[2]
DRY_RUN_TIMEOUT_S = 900
"""Five processes that each import torch and transformers, on a shared 2-core machine."""


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["no-compile", "compiled"])
def test_the_dry_run_runs_every_section_and_writes_its_report(tmp_path, compiled):
    """The default run leaves out the compiled learner steps (torch.compile traces through FSDP2 for
    about a minute on this CPU); the slow lane runs them too."""
    out = tmp_path / "gpu.md"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "check.sh"), "--dry-run", "--out", str(out),
                           "--work", "work", *([] if compiled else ["--no-compile"])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    # --work, relative to where it was called from, keeps every section's files
    for name in ("gpu_tests", "learner_step", "engines", "transports"):
        assert (tmp_path / "work" / f"{name}.status").is_file() and (tmp_path / "work" / f"{name}.log").is_file()
    assert json.loads((tmp_path / "work" / "learner_step.json").read_text())["ok"]
    text = out.read_text()
    assert text.startswith("# GPU checks (DRY RUN")
    for heading in ("## 1. gpu-marked tests: ok", "## 2. Learner step (SAO, FSDP2): ok", "## 3. Serving engines: ok",
                    "## 4. Weight transports: ok"):
        assert heading in text
    # every gpu-marked test is found, the learner ran FSDP2 over a process group, each store round-tripped
    assert "test_real_cuda_export_round_trips_in_the_publishing_process" in text
    assert "on 1 rank(s), backend `gloo`" in text
    if compiled:
        assert "With the bodies compiled (`trainer.compile`), after " in text  # the compiled steps ran under FSDP2
    else:
        assert "With the bodies compiled (`trainer.compile`): not run (`--no-compile`)." in text
        assert "--dry-run --no-compile" in text  # the command written in the report
    assert "At 8 rollouts per rank, eager: median step " in text  # --larger-batch 2 on the dry run's 4
    assert "| TorchEngine |" in text and "| TorchEngine, `kv_layout: flat` |" in text
    # the profiled runs: a learner step, one request through generate and through the engine
    assert "One more eager step under the profiler, per step: wall " in text and "| `aten::mm` |" in text
    assert "One more eager step, the device synchronised around each phase: " in text
    assert "| critic_backward |" in text and "| policy_forward |" in text  # the SAO step's own phase names
    assert "`generate`, one request, per token: wall " in text and "TorchEngine, one request, per token: wall " in text
    assert "| file |" in text and "| shm |" in text and "| cuda-ipc | not run: needs a CUDA device" in text
    assert "Sections: 4 ok, 0 failed" in text


def learner_result(mfu: float | None) -> dict:
    return {"section": "learner_step", "ok": True, "machine": {"platform": "p", "cpus": 16, "python": "3.12",
            "torch": "2.x", "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "cuda": "13.0"},
            "backend": "nccl", "world_size": 1, "size": "half-b", "dtype": "bfloat16", "parameters": 494e6,
            "rollouts_per_rank": 32, "prompt_tokens": 128, "action_tokens": 384, "critic_updates": 2,
            "steps": 2, "step_s": [0.5, 0.5], "step_s_median": 0.5, "tokens_per_s": 32768.0,
            "action_tokens_per_s": 24576.0, "flops_per_step": 1.5e14, "achieved_tflops": 300.0,
            "peak_tflops": 989.4, "mfu": mfu, "skipped_nonfinite": 0.0, "max_memory_gib": 40.0}


def write_section(work: Path, name: str, status: int, result: dict | None) -> None:
    (work / f"{name}.status").write_text(f"{status} 7")
    (work / f"{name}.log").write_text(f"log of {name}\nlast line of {name}\n")
    if result is not None:
        (work / f"{name}.json").write_text(json.dumps(result))


def test_the_report_names_failed_sections_and_the_mfu_verdict(tmp_path):
    write_section(tmp_path, "gpu_tests", 1, None)
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a" time="1.0"/>'
        '<testcase classname="t" name="b" time="2.0"><failure message="boom"/></testcase></testsuite></testsuites>')
    (tmp_path / "gpu_tests.note").write_text("kafka-marked gpu tests deselected: no java\n")
    write_section(tmp_path, "learner_step", 0, learner_result(mfu=0.303))
    write_section(tmp_path, "engines", 124, None)  # ran out of time: no result file
    write_section(tmp_path, "transports", 1, {"section": "transports", "ok": False, "error": "OSError: no shm",
                                              "traceback": "Traceback ...\nOSError: no shm"})
    out = tmp_path / "gpu.md"
    status = report.main(["--work", str(tmp_path), "--out", str(out), "--mode", "gpu", "--command", "check.sh"])
    text = out.read_text()
    assert status == 1
    assert "2 tests, 1 failed or errored" in text and "| `t::b` | failure |" in text
    assert "## 1. gpu-marked tests: FAILED" in text
    assert "Note: kafka-marked gpu tests deselected: no java." in text
    assert "MFU 30.3% is below the 40% target." in text and "NVIDIA H200 (139.8 GiB)" in text
    assert "## 3. Serving engines: FAILED" in text and "No result (ran out of time)" in text
    assert "last line of engines" in text
    assert "## 4. Weight transports: FAILED" in text and "OSError: no shm" in text
    assert "Sections: 1 ok, 3 failed (gpu_tests, engines, transports)" in text

    write_section(tmp_path, "learner_step", 0, learner_result(mfu=0.41))
    report.main(["--work", str(tmp_path), "--out", str(out), "--mode", "gpu", "--command", "check.sh"])
    assert "MFU 41.0% meets the 40% target." in out.read_text()


def test_the_report_gives_the_compiled_steps_or_why_there_are_none(tmp_path):
    for name in ("gpu_tests", "engines", "transports"):
        write_section(tmp_path, name, 124, None)
    out = tmp_path / "gpu.md"
    compiled = {"compile_s": 61.2, "step_s": [0.3, 0.3], "step_s_median": 0.3, "tokens_per_s": 54613.0,
                "achieved_tflops": 500.0, "mfu": 0.505}
    write_section(tmp_path, "learner_step", 0, {**learner_result(mfu=0.303), "compiled": compiled})
    report.main(["--work", str(tmp_path), "--out", str(out), "--mode", "gpu", "--command", "check.sh"])
    text = out.read_text()
    assert "MFU 30.3% is below the 40% target." in text
    assert "after 61.2 s of compiling step: median step 0.300 s, 54613 tokens/s, 500.0 TFLOP/s, MFU 50.5%" in text
    assert "Compiled, MFU 50.5% meets the 40% target." in text

    write_section(tmp_path, "learner_step", 124, {**learner_result(mfu=0.303), "compiled": {"error": "did not finish"}})
    report.main(["--work", str(tmp_path), "--out", str(out), "--mode", "gpu", "--command", "check.sh"])
    text = out.read_text()
    assert "MFU 30.3% is below the 40% target." in text  # the eager result written before compiling
    assert "With the bodies compiled (`trainer.compile`): no result, `did not finish`." in text


def test_the_report_of_some_sections_names_the_others_as_not_run(tmp_path):
    write_section(tmp_path, "learner_step", 0, learner_result(mfu=0.5))
    out = tmp_path / "gpu.md"
    status = report.main(["--work", str(tmp_path), "--out", str(out), "--mode", "gpu", "--command", "check.sh",
                          "--sections", "learner_step"])
    text = out.read_text()
    assert status == 0
    assert "## 2. Learner step (SAO, FSDP2): ok" in text
    assert "## 1. gpu-marked tests: not run in this call (`--sections`)" in text
    assert "## 4. Weight transports: not run in this call (`--sections`)" in text
    assert "Sections: 1 ok, 0 failed;" in text


def test_flops_are_counted_with_eager_attention_in_policy_and_critic_then_restored():
    policy = random_model("tiny", "float32", torch.device("cpu"))
    critic = build_critic(AlgorithmConfig(), policy)
    seen = [policy, *[m for m in critic.modules() if hasattr(m, "set_attn_implementation")]]
    assert len(seen) > 1 and {m.config._attn_implementation for m in seen} == {"sdpa"}
    with eager_attention(policy, critic):
        assert {m.config._attn_implementation for m in seen} == {"eager"}
    assert {m.config._attn_implementation for m in seen} == {"sdpa"}


def test_a_gpu_profile_reads_as_busy_share_waits_and_top_kernels():
    profile = {"units": 4, "wall_ms_per_unit": 40.0, "gpu_busy_ms_per_unit": 10.0, "gpu_busy_share": 0.25,
               "waits_per_unit": {"cudaStreamSynchronize": 3.0}, "top_by": "GPU time (kernels and copies)",
               "top": [{"name": "sm90_gemm|bf16", "ms_per_unit": 6.5, "calls_per_unit": 170.0}]}
    lines = report.profile_lines("TorchEngine, one request", profile, "token")
    assert lines[0] == ("TorchEngine, one request, per token: wall 40.00 ms, GPU busy 10.00 ms (25% of the wall "
                        "time); CUDA calls the host may wait in, per token: `cudaStreamSynchronize` 3.0.")
    assert lines[-1] == "| `sm90_gemm/bf16` | 6.500 | 170.0 |"
    assert report.profile_lines("x", {"error": "RuntimeError: no CUPTI"}, "step") == [
        "x: the profiler failed, `RuntimeError: no CUPTI`."]


def test_the_phase_split_reads_as_seconds_and_shares_of_the_step():
    lines = report.phase_lines({"step_s": 0.5, "phases_s": {"policy_backward": 0.1, "critic_backward": 0.2,
                                                            "arithmetic": 0.05}})
    assert lines[0] == "One more eager step, the device synchronised around each phase: 0.500 s in all."
    assert lines[4:] == ["| critic_backward | 0.2000 | 40.0% |", "| policy_backward | 0.1000 | 20.0% |",
                         "| arithmetic | 0.0500 | 10.0% |", "| outside the timed phases | 0.1500 | 30.0% |"]


def test_the_larger_batch_reads_as_its_own_line_or_its_error():
    line = report.larger_batch_line({"rollouts_per_rank": 64, "step_s": [0.9, 1.0], "step_s_median": 0.95,
                                     "tokens_per_s": 34489.0, "achieved_tflops": 249.2, "mfu": 0.2519,
                                     "max_memory_gib": 90.25})
    assert line == ("At 64 rollouts per rank, eager: median step 0.950 s, 34489 tokens/s, 249.2 TFLOP/s, "
                    "MFU 25.2%, 90.2 GiB at most.")
    assert report.larger_batch_line({"rollouts_per_rank": 64, "error": "out of GPU memory: x"}) == (
        "At 64 rollouts per rank: no result, `out of GPU memory: x`.")
