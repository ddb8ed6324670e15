import pytest
import torch

from ember.executor.model_runner import compute_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("bf16_native", [False, True])
@pytest.mark.parametrize("fp16_native", [False, True])
def test_half_precision_on_cpu_computes_in_fp32_only_where_not_native(
        monkeypatch: pytest.MonkeyPatch, bf16_native: bool, fp16_native: bool) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16_native)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: fp16_native)
    assert compute_dtype(torch.bfloat16, CPU) == (torch.bfloat16 if bf16_native else torch.float32)
    assert compute_dtype(torch.float16, CPU) == (torch.float16 if fp16_native else torch.float32)
    assert compute_dtype(torch.float32, CPU) == torch.float32
    # the CPU's abilities never change what a GPU computes in
    assert compute_dtype(torch.bfloat16, CUDA) == torch.bfloat16
    assert compute_dtype(torch.float16, CUDA) == torch.float16
