"""A saved checkpoint carries its probe (posttrain.probe.json), computed on the weights it saved:
a fresh transformers computation on the saved folder gives the same greedy tokens and logprobs."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from posttrain.chain.probe import PROBE_NAME, probe_prompts, read_probe
from posttrain.datasets.toy import toy_prompt_rows
from posttrain.rewards import length_reward
from posttrain.rollouts.format import write_rollouts
from posttrain.testing.sampler import sample_rollouts
from posttrain.trainer import TrainerConfig, run_training
from posttrain.trainer.checkpoints import inspect_checkpoint


def check_probe_of(folder: Path) -> None:
    """The folder's probe against greedy decoding and a batched forward pass of transformers on it."""
    import torch
    from transformers import AutoModelForCausalLM

    probe = read_probe(folder)
    assert probe is not None, f"{folder} has no {PROBE_NAME}"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    vocab = model.config.vocab_size
    assert (probe.dtype, probe.vocab_size, probe.format) == ("float32", vocab, "posttrain-probe-v1")
    assert probe.prompts == probe_prompts(vocab) and len(probe.prompts) == 4
    with torch.no_grad():
        for prompt, completion, logprobs in zip(probe.prompts, probe.completions, probe.logprobs, strict=True):
            ids = list(prompt)
            for _ in range(8):  # greedy, one token at a time
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            assert ids[len(prompt):] == completion
        batch = torch.tensor([p + c for p, c in zip(probe.prompts, probe.completions, strict=True)])
        logps = torch.log_softmax(model(input_ids=batch).logits.float(), dim=-1)
    for i, (prompt, completion) in enumerate(zip(probe.prompts, probe.completions, strict=True)):
        fresh = [float(logps[i, len(prompt) + j - 1, t]) for j, t in enumerate(completion)]
        assert fresh == pytest.approx(probe.logprobs[i], abs=1e-5)


def test_a_step_checkpoint_has_the_probe_of_its_saved_weights(tiny_model_dir, tmp_path):
    rollouts = sample_rollouts(tiny_model_dir, toy_prompt_rows(2), group_size=2, max_new_tokens=4,
                               reward_func=length_reward)
    config = TrainerConfig(mode="step", model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"),
                           rollouts=str(write_rollouts(tmp_path / "r.jsonl", rollouts)), learning_rate=1e-2,
                           use_cpu=True)
    result = run_training(config)
    inspect_checkpoint(result.checkpoint)  # complete, with its probe already in place
    check_probe_of(result.checkpoint)
    assert not (tiny_model_dir / PROBE_NAME).exists()
    # the update moved the answers: the probe tells the two versions apart
    from transformers import AutoModelForCausalLM

    from posttrain.serve.probe import tolerance, versions_distance
    from posttrain.trainer.probe import compute_probe

    before = compute_probe(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert versions_distance(read_probe(result.checkpoint), before) > tolerance("float32")


def test_grpo_checkpoints_have_the_probe_of_their_saved_weights(tiny_model_dir, staged_toy, tmp_path):
    config = TrainerConfig(
        mode="grpo", model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "run"),
        dataset_manifest=str(staged_toy.manifest_path), reward_funcs=["posttrain.rewards:length_reward"],
        learning_rate=1e-3, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        max_steps=1, save_steps=1, use_cpu=True)
    result = run_training(config)
    assert result.checkpoint == tmp_path / "run" / "checkpoint-1"
    check_probe_of(result.checkpoint)
    # written in _save, before the trainer state that makes the checkpoint complete
    probe_written = (result.checkpoint / PROBE_NAME).stat().st_mtime_ns
    assert probe_written <= (result.checkpoint / "trainer_state.json").stat().st_mtime_ns


def test_the_grpo_save_hook_writes_the_probe_only_where_the_whole_model_is_in_memory(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.grpo import trainer_class

    calls = []

    class Saving:  # stands in for the Trainer: _save writes the weights, then the Trainer its state
        def __init__(self, model, should_save=True):
            self.model = model
            self.args = types.SimpleNamespace(should_save=should_save, output_dir=str(tmp_path))

        def _save(self, output_dir=None, state_dict=None):
            calls.append(output_dir)
            if self.args.should_save:
                self.model.save_pretrained(output_dir)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()
    trainer = trainer_class(Saving, None)(model)
    trainer._save(str(tmp_path / "checkpoint-1"))
    assert model.training  # left as it was
    check_probe_of(tmp_path / "checkpoint-1")
    # weights handed in gathered (FSDP, DeepSpeed): the model in memory may be a shard, no probe
    trainer._save(str(tmp_path / "checkpoint-2"), state_dict=model.state_dict())
    assert not (tmp_path / "checkpoint-2" / PROBE_NAME).exists()
    # a rank that does not save writes nothing
    trainer_class(Saving, None)(model, should_save=False)._save(str(tmp_path / "checkpoint-3"))
    assert not (tmp_path / "checkpoint-3").exists()
    assert len(calls) == 3
