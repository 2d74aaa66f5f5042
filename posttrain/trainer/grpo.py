"""``mode: grpo``: a TRL GRPOTrainer run that resumes from the last complete checkpoint in output_dir.

Launched as several processes (torchrun, one node or many), accelerate makes it data-parallel
(gloo on CPU, nccl on GPU). Rank 0 alone writes: the Trainer already saves weights, optimizer and
trainer state on rank 0 only; the per-rank RNG states (``rng_state_<rank>.pth``, for an exact
resume) are gathered and written by rank 0 too, before its trainer_state.json, so a checkpoint
is complete exactly once and no other rank touches it.

Imports transformers; ``run_training`` imports this module only when a grpo run starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer import TRAINING_ARGS_NAME

from posttrain.datasets.staging import read_staged_rows
from posttrain.lora.adapter import BaseRef, base_fingerprint, write_base_ref
from posttrain.rollouts.scoring import finite_rewards, load_reward_funcs
from posttrain.trainer import distributed, precision, timeline
from posttrain.trainer.checkpoints import (
    IncompleteCheckpoint,
    checkpoint_dirs,
    inspect_checkpoint,
    last_complete_checkpoint,
)
from posttrain.trainer.config import ConfigError, TrainerConfig, TrainingResult
from posttrain.trainer.probe import write_checkpoint_probe
from posttrain.trainer.tracking import grpo_reporting

log = logging.getLogger(__name__)

# Written before trainer_state.json (which the watch requires), so a complete checkpoint has them;
# checking anyway keeps a weights-only folder from being picked for a resume.
RESUME_FILES = ("optimizer.pt", "scheduler.pt")


def run_grpo(config: TrainerConfig, stop_event: threading.Event) -> TrainingResult:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    output_dir = config.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    resume = last_complete_checkpoint(output_dir, required_files=RESUME_FILES)
    assert config.max_steps is not None  # the config validator requires it in grpo mode
    if resume is not None and resume.step >= config.max_steps:
        return TrainingResult(
            mode="grpo",
            global_step=resume.step,
            checkpoint=resume.path,
            resumed_from=resume.path,
            completed=True,
            already_done=True,
        )
    if int(os.environ.get("RANK", "0")) == 0:
        _discard_incomplete_checkpoints(output_dir, after_step=resume.step if resume else -1)

    rows = read_staged_rows(config.dataset_manifest)
    try:
        # a NaN reward (a reward service outage) fails the step naming the function: TRL would sum it as 0
        reward_funcs = [finite_rewards(f, path) for f, path in zip(load_reward_funcs(config.reward_funcs),
                                                                    config.reward_funcs, strict=True)]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path)
    tokenizer.padding_side = "left"  # GRPOTrainer generates from left-padded prompts
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        config.model_name_or_path, dtype=torch.bfloat16 if config.bf16 else torch.float32
    )
    stopper = StopOnRequest(stop_event)
    base_ref = lora_base_ref(config)
    report_to, trackers = grpo_reporting(config, is_main=int(os.environ.get("RANK", "0")) == 0)
    save_dtype = precision.resolve_save_dtype(config.save_dtype, config.model_name_or_path) \
        if Path(config.model_name_or_path).is_dir() else None  # a hub id: saved as trained
    trainer = rank0_writes(trainer_class(GRPOTrainer, base_ref, save_dtype))(
        model=model,
        reward_funcs=reward_funcs,
        args=grpo_arguments(config, report_to=report_to),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[stopper, timeline.callback(), *trackers],
        peft_config=config.lora.peft_config() if config.lora else None,
    )
    if trainer.args.world_size > 1:
        import torch.distributed as dist

        log.info(distributed.describe(distributed.ranks(), dist.get_backend()))
    if resume is not None:
        log.info("resuming from %s", resume.path)
    output = trainer.train(resume_from_checkpoint=str(resume.path) if resume else None)
    last = last_complete_checkpoint(output_dir)
    global_step = trainer.state.global_step
    return TrainingResult(
        mode="grpo",
        global_step=global_step,
        checkpoint=last.path if last else None,
        resumed_from=resume.path if resume else None,
        completed=global_step >= config.max_steps,
        stopped_early=stopper.stopped,
        metrics=_final_metrics(output.metrics, trainer.state.log_history),
    )


def rank0_writes(trainer_class):
    """``trainer_class`` whose RNG states are all written by rank 0 (each rank's, gathered)."""

    class Rank0Writes(trainer_class):
        def _save_rng_state(self, output_dir: str) -> None:
            import tempfile

            import torch.distributed as dist

            if self.args.world_size <= 1 or not dist.is_initialized():
                return super()._save_rng_state(output_dir)
            with tempfile.TemporaryDirectory(prefix="posttrain-rng-") as tmp:  # node-local, this rank's
                super()._save_rng_state(tmp)
                name = f"rng_state_{self.args.process_index}.pth"
                mine = (name, Path(tmp, name).read_bytes())
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                for name, data in gathered:
                    Path(output_dir, name).write_bytes(data)

    Rank0Writes.__name__ = Rank0Writes.__qualname__ = f"Rank0Writes{trainer_class.__name__}"
    return Rank0Writes


def lora_base_ref(config: TrainerConfig) -> BaseRef | None:
    """With ``lora``: the base the adapter trains on (a local folder: merges read it), fingerprinted once."""
    if config.lora is None:
        return None
    base = Path(config.model_name_or_path)
    if not base.is_dir():
        raise ConfigError(f"model_name_or_path {str(base)!r}: with lora, the base must be a local model folder "
                          "(each checkpoint references it, and merges read it)")
    return BaseRef(path=str(base), fingerprint=base_fingerprint(base))


def trainer_class(cls, base_ref: BaseRef | None, save_dtype=None):
    """``cls`` subclassed so that its saves write the weights in ``save_dtype`` (None: as trained; with
    the float32 ones beside them when that is coarser, which a resume loads: ``posttrain.trainer.precision``)
    and, in ``_save`` (after the weights, before ``trainer_state.json``, which makes a checkpoint
    complete), the checkpoint's probe (``posttrain.trainer.probe``) on the weights as saved or, with
    LoRA, the base reference beside the adapter."""

    class PosttrainTrainer(cls):
        def _save(self, output_dir: str | None = None, state_dict=None) -> None:
            out = output_dir or self.args.output_dir
            whole = self.args.should_save and _whole_model_in_memory(self, state_dict)
            trained = next(self.model.parameters()).dtype
            if base_ref is None and save_dtype is not None and whole and trained != save_dtype:
                saved = precision.saved_model(self.model, save_dtype)
                os.makedirs(out, exist_ok=True)
                saved.save_pretrained(out)  # its config.json names the saved dtype, which engines load in
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(out)
                torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))
                if precision.is_coarser(save_dtype, trained):
                    precision.save_master(self.model, Path(out))
            else:
                super()._save(output_dir, state_dict)
                saved = self.model
            if base_ref is not None:
                write_base_ref(out, base_ref)  # LoRA: no probe (see write_checkpoint_probe)
            elif whole and saved is self.model:
                write_checkpoint_probe(saved, out)
            elif whole:  # the folder as an engine loads it: a cast copy of TRL's model scored 0.004 off it
                from transformers import AutoModelForCausalLM

                write_checkpoint_probe(AutoModelForCausalLM.from_pretrained(out), out)

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            target = model if model is not None else self.model
            if base_ref is None and next(target.parameters()).dtype == torch.float32:
                precision.load_master(target, Path(resume_from_checkpoint))  # the weights as trained, not rounded

    PosttrainTrainer.__name__ = PosttrainTrainer.__qualname__ = f"Posttrain{cls.__name__}"
    return PosttrainTrainer


def _whole_model_in_memory(trainer, state_dict) -> bool:
    """Whether ``trainer.model`` on this (the saving) rank holds every weight just saved, so the probe
    can be computed on it alone. True for one process and for data parallelism (DDP: every rank a
    full replica; the forward pass on the unwrapped model needs no collective). False when the
    weights came in as a gathered ``state_dict`` (FSDP, DeepSpeed, SageMaker MP) or the model is
    sharded at load time (tensor parallelism): a forward pass there needs every rank, so those
    checkpoints carry no probe (consumers read the probe as optional).
    """
    return state_dict is None and not getattr(trainer, "is_distributed_loading_by_transformers", False)


def grpo_arguments(config: TrainerConfig, report_to: list[str] | None = None):
    """TRL's GRPOConfig for a TrainerConfig: full checkpoints (resumable), no vLLM. ``report_to``:
    the trackers TRL adds itself (``grpo_reporting``: TensorBoard is a callback of ours); None: none."""
    from trl import GRPOConfig

    # transformers 5 renamed gradient_checkpointing (TRL defaults it to True) and warns on the old name.
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return GRPOConfig(
        output_dir=str(config.output_dir),
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        loss_type=config.loss_type,
        scale_rewards=config.scale_rewards,
        num_iterations=config.num_iterations,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=0,  # the inference deployment supports only temperature and top_p
        reward_weights=config.reward_weights,
        logging_steps=config.logging_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        save_only_model=False,  # optimizer, scheduler and RNG state are what make a resume exact
        seed=config.seed,
        bf16=config.bf16,
        use_cpu=config.use_cpu,
        use_vllm=False,
        report_to=report_to or "none",
        run_name=config.run_name,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **{checkpointing: config.gradient_checkpointing},
    )


class StopOnRequest(TrainerCallback):
    """Once ``stop_event`` is set, save a checkpoint at the end of the current step and stop."""

    def __init__(self, stop_event: threading.Event):
        self.stop_event = stop_event
        self.stopped = False

    def on_step_end(self, args, state, control, **kwargs):
        if self._requested(args) and state.global_step < state.max_steps:
            log.warning("stop requested: saving checkpoint-%d and stopping", state.global_step)
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def _requested(self, args) -> bool:
        """Whether any rank was asked to stop: all ranks must save and stop at the same step."""
        requested = self.stop_event.is_set()
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor(float(requested), device=args.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            requested = bool(flag.item())
        return requested


def _discard_incomplete_checkpoints(output_dir: Path, after_step: int) -> None:
    """Remove checkpoint folders a killed attempt left half-written; training rewrites those steps."""
    for step, path in checkpoint_dirs(output_dir):
        if step <= after_step:
            continue
        try:
            inspect_checkpoint(path)
        except IncompleteCheckpoint as e:
            log.warning("removing incomplete checkpoint left by an earlier attempt: %s", e)
            shutil.rmtree(path, ignore_errors=True)


def _final_metrics(train_metrics: dict, log_history: list[dict]) -> dict[str, float]:
    metrics = {k: float(v) for k, v in train_metrics.items() if isinstance(v, int | float)}
    for entry in reversed(log_history):  # the last step's training log (reward, loss, ...)
        if "reward" in entry:
            metrics.update({k: float(v) for k, v in entry.items() if isinstance(v, int | float)})
            break
    return metrics
