"""Config classes of the ``[run]`` and ``[engine]`` recipe tables (light: attrs only)."""

from __future__ import annotations

import attrs

from octfw.recipe.fields import Location, choices, doc, in_range, positive

__all__ = ["RunConfig", "EngineConfig"]


@attrs.frozen
class RunConfig:
    """``[run]``: what to train for, where, and where results go."""

    name: str | None = doc("Run name; default: the recipe file's name.", default=None)
    seed: int = doc("Seed for parameters, data order, views and masks.", default=0)
    output_dir: Location = doc(
        "Folder that receives one directory per run.", default=Location("runs")
    )
    max_steps: int | None = doc(
        "Stop after this many update steps (caps `epochs` when both are set).",
        default=None, validator=positive,
    )
    epochs: int | None = doc(
        "Number of passes over the dataset, converted to update steps once at start.",
        default=None, validator=positive,
    )
    device: str = doc(
        "auto (xla if torch_xla and an accelerator are present, else cuda, else cpu), cpu, cuda or xla.",
        default="auto", validator=choices("auto", "cpu", "cuda", "xla"),
    )
    cache_dir: Location | None = doc(
        "Persistent cache for synthetic cohorts and decoded volumes; "
        "default $OCTFW_CACHE_DIR or ~/.cache/octfw.",
        default=None,
    )
    export_encoder: bool = doc(
        "When the run finishes, write its target encoder to RUN/encoder/ as a Hugging Face Hub-style "
        "folder (what `octfw export --format safetensors` writes; loggers such as wandb can upload it).",
        default=True,
    )

    def __attrs_post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set run.max_steps or run.epochs (or both)")


@attrs.frozen
class EngineConfig:
    """``[engine]``: optimisation and cadence. Every interval counts update steps."""

    per_device_batch: int = doc("Samples per device per micro-step.", default=1, validator=positive)
    grad_accum_steps: int = doc(
        "Micro-steps accumulated into one update step (derived from the devices when "
        "`global_batch` is set).", default=1, validator=positive
    )
    global_batch: int | None = doc(
        "Samples per update step over all devices, kept whatever the machine: `grad_accum_steps` "
        "is then derived as global_batch / (per_device_batch x devices), and a count that does not "
        "divide is refused. Leave out to train per_device_batch x devices x grad_accum_steps.",
        default=None, validator=attrs.validators.optional(positive),
    )
    precision: str = doc(
        "auto (bf16 on xla and cuda, fp32 on the CPU), fp32 or bf16.",
        default="auto", validator=choices("auto", "fp32", "bf16"),
    )
    base_lr: float = doc("Peak learning rate (AdamW).", default=1e-4, validator=positive)
    weight_decay: float = doc(
        "AdamW weight decay on weights; biases and norms get none.",
        default=0.05, validator=in_range(0.0, 1.0),
    )
    betas: tuple[float, float] = doc("AdamW betas.", default=(0.9, 0.95))
    eps: float = doc("AdamW epsilon.", default=1e-8, validator=positive)
    log_every_steps: int = doc(
        "Read metrics from the device and log them every N update steps.",
        default=10, validator=positive,
    )
    checkpoint_every_steps: int | None = doc(
        "Save a checkpoint every N update steps (and at the end); unset: at the end only.",
        default=None, validator=positive,
    )
    num_workers: int | None = doc(
        "Data-loader worker processes per training process (0 = load in the training process). "
        "Leave out to derive it from the machine: on cuda and xla, the cores this process may use "
        "(its share of the host's, minus one for itself), at most 8; on the cpu device 0 (training "
        "itself uses the cores). `octfw bench --data-only` measures what one worker delivers.",
        default=None, validator=attrs.validators.optional(in_range(0, 256)),
    )
    parallelism: str = doc(
        "How the job's processes share the model: data (each holds all of it, and its gradients, "
        "AdamW moments and EMA encoder; gradients all-reduced: DDP) or fsdp (each holds 1/N of "
        "them, a transformer block gathered for its forward and backward only: FSDP2, cuda and cpu). "
        "The same numbers either way; a checkpoint of one resumes the other.",
        default="data", validator=choices("data", "fsdp"),
    )
    reshard_after_forward: bool = doc(
        "fsdp: free a block's gathered parameters after its forward and gather them again for its "
        "backward (less memory, one more all-gather per block).",
        default=True,
    )
    compile: bool = doc(
        "torch.compile the model (cuda only; refused on xla, where it caused the "
        "seeds' compile-worker storm). `octfw check` then reports the graphs, graph breaks "
        "and recompilations of one training step.",
        default=False,
    )
    domain_sampling: str = doc(
        "natural (every file once per epoch) or balanced (each epoch draws the same "
        "number of samples from every domain, repeating files of small domains).",
        default="natural", validator=choices("natural", "balanced"),
    )
    peak_flops_per_device: float | None = doc(
        "Peak FLOP/s of one device for the MFU metric; unset: known accelerators are "
        "recognised, others report 'unknown peak'.",
        default=None, validator=positive,
    )
    save_deadline_s: float = doc(
        "Seconds the end of a run, or a stop on SIGTERM/SIGINT, waits for its last checkpoint "
        "(including a save still in flight). A preemptible VM gets about 30 s of notice, which "
        "must also cover finishing the update step and closing the loggers. Saves during "
        "training run in the background and never wait.",
        default=15.0, validator=positive,
    )
    heartbeat_s: float = doc(
        "Warn when no update step completes for this many seconds.",
        default=600.0, validator=positive,
    )
    collective_timeout_s: float = doc(
        "Longest wait for another process of the job, in any collective and in the launcher's "
        "rendezvous. A process that died or stopped answering ends the others within this bound, "
        "exit 76, naming it. Must exceed save_deadline_s (the others wait for rank 0's final save).",
        default=600.0, validator=positive,
    )

    def __attrs_post_init__(self) -> None:
        for beta in self.betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"engine.betas must each be in [0, 1), got {list(self.betas)}")
        if self.global_batch is not None and self.grad_accum_steps != 1:
            raise ValueError(f"set engine.global_batch ({self.global_batch}; the micro-steps follow from the "
                             f"devices) or engine.grad_accum_steps ({self.grad_accum_steps}), not both")
        if self.collective_timeout_s <= self.save_deadline_s:
            raise ValueError(f"engine.collective_timeout_s ({self.collective_timeout_s:g}) must exceed "
                             f"engine.save_deadline_s ({self.save_deadline_s:g}): the other processes wait "
                             "for rank 0's final save")
