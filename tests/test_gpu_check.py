"""The prepared GPU check (benchmarks/gpu_check.py) runs its whole path on the CPU as a smoke run
(tiny model, nothing written), and refuses to report GPU figures without a GPU."""

import pytest
import torch

from benchmarks import gpu_check

torch.set_num_threads(1)


def test_smoke_run_on_the_cpu_measures_every_figure(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = gpu_check.main(["--allow-cpu", "--quick", "--out", str(tmp_path)])
    assert result["workload"]["placement"]["device"] == "cpu"
    assert result["tokens_per_s"] > 0 and result["n_params"] > 0
    assert result["checkpoint_ms_median"] > 0 and result["decision_act_us_median"] > 0
    assert result["mfu"] is None  # no peak for a CPU: no made-up MFU
    assert (tmp_path / "gpu.md").read_text().count("GPU check on cpu") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
def test_without_a_gpu_it_exits_2_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert not list(tmp_path.iterdir())


def test_peak_table_and_flops_estimate():
    assert gpu_check.peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert gpu_check.peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None
    per_token = gpu_check.flops_per_token(1_000_000, {"n_layer": 2, "n_embd": 64}, 128)
    assert per_token == 6e6 + 12 * 2 * 64 * 128
