"""Loaded at start-up by every process of a test vLLM server (``_vllm.VllmServer`` puts this folder on PYTHONPATH).

With ``WEIGHTSYNC_TEST_NO_AMX=1``, vLLM's CPU backend takes the code paths of an x86 CPU without AMX.
On a CPU with AMX tiles (Sapphire Rapids and later) vLLM 0.32 otherwise packs every small bf16 Linear
weight for its AMX kernel (``check_cpu_sgl_kernel`` in vllm/model_executor/layers/utils.py) and
empties the parameter, so ``/weight_checker`` hashes no bytes; and that kernel's brgemm needs oneDNN's
AMX ukernel, which the server's ``ONEDNN_MAX_CPU_ISA=AVX2`` cap turns off (the engine core aborts at
warm-up). vLLM asks ``torch.cpu._is_amx_tile_supported()`` and nothing else, so answering False here
gives the engine of a CPU without AMX: torch's linear on plain parameters, the vector attention kernel.
"""

import os

if os.environ.get("WEIGHTSYNC_TEST_NO_AMX") == "1":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
