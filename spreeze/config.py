"""The one run configuration: the frozen :class:`Config` dataclass, its checks and the small rules derived from it.

Every setting is a field with a docstring under it (the CleanRL ``Args`` style); the command line is generated
from them (:mod:`spreeze.flags`) and the settings are layered from defaults, presets, ``--config`` files and flags
in :mod:`spreeze.settings`.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass

from spreeze.values import FIELD_CHOICES, ConfigError, flag_name, one_of, parse_env_kwargs



@dataclass(frozen=True)
class Config:
    env_id: str = "Walker2DBulletEnv-v0"
    """gymnasium environment id with a continuous (Box) action space"""
    env_kwargs: tuple[str, ...] = ()
    """keyword arguments of the env's constructor as key=value (values read as YAML scalars: 9.81, true, text),
    passed to gym.make in every process"""
    wrapper: tuple[str, ...] = ()
    """module:callable taking an env and returning the wrapped env (a gymnasium.Wrapper class, say); repeatable,
    applied in the order given in every process that builds the env"""
    preset: str = "auto"
    """per-env hyperparameters shipped in spreeze/presets/: auto (the preset whose env patterns match --env, if
    any), none, or a preset's name; flags and --config override its values"""
    config_file: str = ""
    """YAML file of settings (flag names as keys, dashes or underscores): above the preset, below flags"""
    algo: str = "sac"
    """off-policy algorithm: sac, td3 or crossq (SAC with batch-renormalised critics and no target networks,
    Bhatt et al. 2024)"""
    seed: int = 0
    """seed of the networks, the environments and the exploration noise"""
    samplers: int = 0
    """number of sampler processes; 0 chooses from the machine's cores"""
    envs_per_sampler: int = 4
    """environments stepped by each sampler with one batched policy forward pass"""
    batch_size: int = 0
    """learner batch size; 0 chooses one for the machine (256 on CPU), or 256 with --deterministic"""
    buffer_size: int = 1_000_000
    """replay capacity in transitions, held in shared memory"""
    learning_starts: int = 10_000
    """env steps of uniform random actions before the learner starts (it starts once a full batch is in the
    replay too: uniform actions go on until then)"""
    total_steps: int = 0
    """stop after this many env steps in total over all samplers (0: no limit; with no budget at all the run
    trains until Ctrl-C or SIGTERM, keeping its best policy in best/)"""
    minutes: float = 0.0
    """stop after this many minutes of wall-clock time (0: no limit)"""
    target_return: typing.Optional[float] = None
    """stop once the mean of the last 5 test returns reaches this value (unset: never; ``none`` unsets a resumed
    run's)"""
    collect_per_update: float = -1.0
    """collect:update ratio (PQL beta_a:v): env steps collected per critic update over all samplers; 0 runs free; -1 scales it with the batch (batch / replay_ratio)"""
    replay_ratio: float = 32.0
    """with --collect-per-update -1: times each collected transition is sampled on average (Spreeze's Walker run: 3.7e5 frames/s over 15,342 steps/s, about 24)"""
    n_step: int = 1
    """n-step returns: each stored transition sums n discounted rewards and bootstraps from the state n steps
    later with gamma**n (shorter at a termination; 1 is the plain one-step target)"""
    gamma: float = 0.98
    """discount factor (0.98 and the rates below follow rl-baselines3-zoo's tuned SAC for the PyBullet tasks)"""
    tau: float = 0.02
    """target network soft-update coefficient"""
    actor_lr: float = 7.3e-4
    """actor learning rate"""
    critic_lr: float = 7.3e-4
    """critic learning rate"""
    hidden_size: int = 256
    """units in each hidden layer of the actor (and of the critics unless --critic-hidden-size)"""
    narrow_hidden_size: int = 0
    """a narrower --hidden-size the profile takes instead where the CPU learner runs in float32 (bf16 autocast did
    not pay, or is off), which then sets the pace (autotune/decide.py: choose_hidden_size); 0: never. Unused when
    --hidden-size or --critic-hidden-size is given, under --deterministic, with a GPU learner and on resume; the
    PyBullet presets set it"""
    normalize_obs: bool = False
    """normalise observations by a running mean and variance (learned from the replay's rows, carried with the
    actor's weights to every process and into saved policies); for envs with badly scaled observations"""
    critic_hidden_size: int = 0
    """units in each hidden layer of the critics; 0: --hidden-size (CrossQ's authors widen them to 2048)"""
    critic_atoms: int = 0
    """SAC/TD3: 0 for scalar critics; N > 1 for categorical distributional critics over N evenly spaced returns
    trained by cross-entropy (C51, as FastTD3 pairs with large batches; 101 there)"""
    critic_layer_norm: bool = False
    """SAC/TD3: a LayerNorm before each hidden activation of the critics, which keeps Q from running away on
    data the policy has left (RLPD, Ball et al. 2023); crossq has batch renormalisation instead"""
    lr_schedule: str = "constant"
    """learning rates over the run: constant, or linear (rl-baselines3-zoo's lin_*: from the given rates down to
    zero at the end of the budget, --total-steps or --minutes, whichever ends first; constant without a budget)"""
    q_range: str = "auto"
    """--critic-atoms: the returns the atoms span, MIN,MAX (on the command line --q-range=-100,100); auto sets it
    at the first update from that batch's largest reward (a wide range keeps the mean, a narrow one clips returns)"""
    hidden_layers: int = 2
    """hidden layers in actor and critics"""
    alpha_lr: float = 7.3e-4
    """SAC: learning rate of the entropy temperature (automatic entropy tuning)"""
    initial_alpha: float = 1.0
    """SAC: initial entropy temperature"""
    policy_delay: int = 0
    """actor:critic update ratio as critic updates per actor update (TD3's delayed actor, applied to SAC too; PQL's
    beta_p:v is its inverse); 0 takes the algorithm's default: 1 for SAC, 2 for TD3, 3 for CrossQ"""
    learner_overlap: bool = False
    """SAC: the actor's update runs in a second thread of the learner beside the critics' (PQL's parallel policy and
    value learners, in one process), reading a frozen copy of the critics from before this step's critic update;
    for a CPU learner with a core to spare. Not with --deterministic: the two threads draw noise in no fixed order"""
    target_noise: float = 0.2
    """TD3: std of the target policy smoothing noise"""
    target_noise_clip: float = 0.5
    """TD3: clip of the target policy smoothing noise"""
    noise_min: float = 0.05
    """TD3: smallest exploration sigma of PQL's mixed noise (one sigma per env, spread to noise_max)"""
    noise_max: float = 0.8
    """TD3: largest exploration sigma of PQL's mixed noise"""
    actor_device: str = "auto"
    """device of the actor: auto (cuda:0 if there is a GPU), cpu, cuda:N"""
    critic_device: str = "auto"
    """device of the twin critics: auto (cuda:1 with two GPUs, else the actor's), cpu, cuda:N"""
    replay_mirror: str = "auto"
    """where the learner's batches are gathered: auto (from a copy of the replay in the critics' GPU memory when
    they are on a GPU, else from shared memory on the CPU), on (from the copy on whatever device, a CPU too),
    off (from shared memory); a copy that would not fit in free GPU memory is skipped with a warning"""
    bf16: typing.Optional[bool] = None
    """learner forward/backward under bfloat16 autocast (output layers stay float32): faster on CPUs with
    AMX/avx512_bf16, slower on some GPUs; unset: the profile times both at the smallest batch and takes bf16
    only if clearly faster (float32 with --deterministic, whose curves must not depend on the machine)"""
    cuda_graphs: typing.Optional[bool] = None
    """learner on one GPU: capture each update (losses, backward passes, Adam steps, target step) once as a CUDA
    graph and replay it, one launch instead of hundreds of small kernels whose launching keeps a GPU mostly idle;
    actor and critics on the same CUDA device, not with --learner-overlap, --lr-schedule linear or --deterministic;
    unset: on wherever it can be (a learner on cuda:0 and none of those flags), off otherwise"""
    learner_threads: int = 0
    """torch threads of the learner on CPU; 0 takes the cores left over by the samplers"""
    write_block: int = 32
    """transitions a sampler stages per env before one locked write into the replay"""
    experience_transport: str = "shm"
    """how experience reaches the learner: shm (samplers write into the shared replay) or queue (blocks sent
    through a multiprocessing.Queue into a replay of the learner's own: the Spreeze Fig. 3a ablation, slower)"""
    queue_size: int = 64
    """--experience-transport queue: queue capacity in sampler write blocks (a full queue blocks the samplers)"""
    ray: str = ""
    """Ray cluster to place --remote-samplers on as actors: auto (the cluster `ray start` made on this machine),
    host:port or ray://host:port; empty: none (nothing of Ray is imported). Needs the ray extra"""
    remote_samplers: int = 0
    """--ray: sampler actors on the cluster's nodes, on top of the local --samplers, each with --envs-per-sampler
    envs and replay regions of its own; 0 with --ray: one per CPU of the cluster"""
    remote_only: bool = False
    """--ray: no local sampler processes at all (no spares either): every env step comes from --remote-samplers;
    the run ends when the remote part does (a lost cluster), since nothing else would feed the learner"""
    remote_inflight: int = 2
    """--ray: requests a remote sampler may have open to the ingest process, each for one or more blocks of
    --write-block steps; with that many unread it waits (back-pressure), so nothing is dropped"""
    batch_rule: str = "noise"
    """how an automatic batch is chosen (--batch-size 0): noise (the batch that minimises seconds per update x
    (1 + B_noise/B) with the critic's measured gradient noise scale, re-decided as it changes during the run)
    or knee (where the learner's frame rate stops growing, fixed for the run)"""
    noise_scale_interval: int = 200
    """critic updates between two measurements of the critic's gradient noise scale (McCandlish et al. 2018),
    logged as noise_scale in metrics.csv; costs two extra critic backward passes per measurement; 0: off (the noise
    batch rule then has nothing to choose by: give --batch-rule knee or a --batch-size)"""
    publish_interval_s: float = 0.1
    """seconds between actor weight publications by the learner"""
    eval_interval_s: float = 5.0
    """seconds between the starts of two test evaluations (with --serial, from the end of one, which holds
    training up, to the start of the next)"""
    eval_episodes: int = 1
    """deterministic episodes per test evaluation"""
    log_interval_s: float = 5.0
    """seconds between metrics.csv rows and console progress lines"""
    checkpoint_interval_s: float = 180.0
    """seconds between checkpoints (one is always written at the end)"""
    max_restarts_per_minute: int = 3
    """restarts of one dead sampler or evaluator allowed per minute before it is left stopped"""
    spare_samplers: int = 1
    """sampler processes started paused, which the CPU governor resumes when the CPU is under target"""
    cpu_target_percent: float = 75.0
    """CPU utilisation the governor steers toward by pausing/resuming samplers (Spreeze: about 75 %)"""
    tensorboard: bool = True
    """TensorBoard event files in <run>/tensorboard (test return, losses, temperature, throughput, utilisation);
    --no-tensorboard turns them off"""
    wandb: bool = False
    """also log those scalars to Weights & Biases (needs the wandb extra; WANDB_MODE=offline works without an
    account)"""
    window: bool = True
    """live reward-curve window when a display is available (else curve.png every few seconds); --no-window turns it off"""
    render: bool = False
    """visualization process playing the newest policy now and then: PyBullet GUI with a display, else GIFs in videos/"""
    reprofile: bool = False
    """measure this machine again instead of reusing the cached profile"""
    cache_dir: str = ""
    """profile cache directory; empty means $SPREEZE_CACHE_DIR, else the user cache folder (~/.cache/spreeze on Linux)"""
    save_replay: bool = False
    """write the replay (its filled rows) beside every checkpoint, so that --resume continues with it instead of
    refilling from scratch; costs disk space and about a second per GiB at each checkpoint"""
    resume: str = ""
    """run directory to continue from its last checkpoint (weights, optimizers, temperature, counters, curves); budgets count the whole run"""
    run_dir: str = ""
    """directory of this run; empty means runs/<env>-<algo>-<timestamp>"""
    serial: bool = False
    """run sampler, learner and evaluator in this one process, for debugging"""
    deterministic: bool = False
    """reproducible mode: lock-step rounds with a policy lag of exactly one round, so runs with the same seed and
    --num-envs give the same curves whatever the number of samplers (CPU: bit for bit); slower than free-running"""
    num_envs: int = 0
    """--deterministic: environments in total, spread over the sampler processes; 0 means 8, whatever the machine"""
    steps_per_round: int = 32
    """--deterministic: steps of every env per lock-step round (HTS-RL's synchronization interval alpha)"""
    eval_every_steps: int = 10_000
    """--deterministic: env steps between test evaluations (at round ends; free-running uses --eval-interval-s)"""

    @property
    def sampler_processes(self) -> int:
        """Sampler processes started: the active ones and the paused spares (:attr:`spares`)."""
        if self.remote_only:
            return 0
        return self.samplers + self.spares

    @property
    def spares(self) -> int:
        """Paused spare samplers in force: none in lock-step rounds (every sampler process takes part in every
        round), with ``--serial`` (its samplers step in the one process, and none steps in for another) or with
        remote samplers only."""
        return 0 if self.deterministic or self.serial or self.remote_only else self.spare_samplers

    @property
    def total_envs(self) -> int:
        """Environments of the run, one replay region each (paused spares' envs included)."""
        if self.deterministic:
            return self.num_envs or DETERMINISTIC_NUM_ENVS
        return (self.sampler_processes + self.remote_samplers) * self.envs_per_sampler

    @property
    def active_envs(self) -> int:
        """Environments stepped from the start: together their replay regions hold ``buffer_size``."""
        if self.deterministic:
            return self.total_envs
        return (self.samplers + self.remote_samplers) * self.envs_per_sampler

    @property
    def region_capacity(self) -> int:
        """Replay slots per env: the buffer split over the active envs (spares get regions of this size too)."""
        return self.buffer_size // max(self.active_envs, 1)

    @property
    def effective_policy_delay(self) -> int:
        """Critic updates per actor update in force: ``--policy-delay``, or the algorithm's default for 0
        (TD3 delays its actor by 2 as in Fujimoto et al. 2018, CrossQ by 3 as in Bhatt et al. 2024; SAC updates
        both every step as in Haarnoja et al.)."""
        if self.policy_delay:
            return self.policy_delay
        return {"td3": 2, "crossq": 3}.get(self.algo, 1)

    def mirror_wanted(self, critic_device) -> bool:
        """``--replay-mirror`` in force: auto keeps a GPU copy of the replay iff the critics (which hold it) are on a
        CUDA device (``critic_device`` a name or a torch.device); never with ``--experience-transport queue``, whose
        replay is the learner's own (and whose profile must not time one). Torch-free: the profile cache keys on it."""
        if self.experience_transport != "shm":
            return False
        return self.replay_mirror == "on" or (self.replay_mirror == "auto" and str(critic_device).startswith("cuda"))

    @property
    def q_range_bounds(self) -> tuple[float, float] | None:
        """``--q-range`` as (min, max), or None for auto."""
        if self.q_range == "auto":
            return None
        try:
            low, high = (float(part) for part in self.q_range.split(","))
        except ValueError:
            raise ConfigError(f"--q-range must be auto or MIN,MAX (two numbers), not {self.q_range!r}") from None
        if not low < high:
            raise ConfigError(f"--q-range needs MIN < MAX, got {self.q_range!r}")
        if not all(math.isfinite(v) and abs(v) < 1e38 for v in (low, high)):  # the atoms are float32
            raise ConfigError(f"--q-range needs finite bounds within float32's range, got {self.q_range!r}")
        return low, high

    @property
    def critic_width(self) -> int:
        """Units per critic hidden layer in force."""
        return self.critic_hidden_size or self.hidden_size

    @property
    def collect_ratio(self) -> float:
        """The collect:update ratio in force: env steps per critic update (0: free-running)."""
        return collect_ratio(self.collect_per_update, self.batch_size, self.replay_ratio)

    @property
    def learning_begins_at(self) -> int:
        """Env steps after which the learner trains: the warm-up, and at least one full batch."""
        return max(self.learning_starts, self.batch_size, 1)

    def validate(self) -> None:
        """Raise :class:`ConfigError` on the first setting that cannot work (env checks live in envs.py)."""
        for name, choices in FIELD_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"--{flag_name(name)} must be {one_of(choices)}, not {getattr(self, name)!r}")
        for name in _FLOAT_FIELDS:  # the range checks below are all false for nan, and most let inf through
            value = getattr(self, name)
            if math.isnan(value) or (math.isinf(value) and name != "minutes"):  # --minutes inf: no time limit
                raise ConfigError(f"--{flag_name(name)} must be a finite number, got {value}")
        positive = ["envs_per_sampler", "buffer_size", "hidden_size", "hidden_layers", "n_step",
                    "max_restarts_per_minute",
                    "write_block", "queue_size", "remote_inflight", "eval_episodes", "steps_per_round", "eval_every_steps"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{flag_name(name)} must be positive, got {getattr(self, name)}")
        non_negative = ["seed", "samplers", "batch_size", "learning_starts", "total_steps", "minutes",
                        "learner_threads", "target_noise", "target_noise_clip", "spare_samplers",
                        "policy_delay", "num_envs", "noise_scale_interval", "critic_hidden_size", "critic_atoms",
                        "remote_samplers", "narrow_hidden_size"]
        if self.collect_per_update < 0 and self.collect_per_update != -1:
            raise ConfigError(f"--collect-per-update must be >= 0 or -1 (scale with the batch), got {self.collect_per_update}")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"--{flag_name(name)} must be >= 0, got {getattr(self, name)}")
        for name in ["replay_ratio", "actor_lr", "critic_lr", "alpha_lr", "initial_alpha", "publish_interval_s",
                     "eval_interval_s", "log_interval_s", "checkpoint_interval_s"]:
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{flag_name(name)} must be positive, got {getattr(self, name)}")
        if not 0 < self.cpu_target_percent <= 100:
            raise ConfigError(f"--cpu-target-percent must be in (0, 100], got {self.cpu_target_percent}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"--gamma must be in (0, 1], got {self.gamma}")
        if not 0 < self.tau <= 1:
            raise ConfigError(f"--tau must be in (0, 1], got {self.tau}")
        if not 0 <= self.noise_min <= self.noise_max:
            raise ConfigError(f"need 0 <= --noise-min <= --noise-max, got {self.noise_min} and {self.noise_max}")
        if self.critic_atoms == 1:
            raise ConfigError("--critic-atoms must be 0 (scalar critics) or at least 2")
        if self.critic_atoms and self.algo == "crossq":
            raise ConfigError("--critic-atoms applies to sac and td3; crossq's critics are scalar")
        if self.learner_overlap and self.algo != "sac":
            raise ConfigError(f"--learner-overlap applies to sac; {self.algo} updates its actor in the critic's step")
        if self.learner_overlap and self.deterministic:
            raise ConfigError("--learner-overlap cannot be --deterministic: its two threads draw noise in no fixed order")
        if self.cuda_graphs and self.learner_overlap:
            raise ConfigError("--cuda-graphs records the whole update on one stream: not with --learner-overlap")
        if self.cuda_graphs and self.deterministic:
            raise ConfigError("--cuda-graphs is not --deterministic: its eager warm-ups and replays are not shown to "
                              "give the same bits, nor a resumed run the same curve")
        if self.cuda_graphs and self.lr_schedule != "constant":
            raise ConfigError("--cuda-graphs replays the learning rate it was captured with: it needs --lr-schedule constant")
        if self.cuda_graphs and "cpu" in (self.actor_device, self.critic_device):
            raise ConfigError("--cuda-graphs needs the learner on a CUDA device, not --actor-device/--critic-device cpu")
        if self.critic_layer_norm and self.algo == "crossq":
            raise ConfigError("--critic-layer-norm applies to sac and td3; crossq's critics are batch-renormalised")
        self.q_range_bounds  # raises on a malformed --q-range
        if self.batch_size > self.buffer_size:
            raise ConfigError(f"--batch-size {self.batch_size} is larger than --buffer-size {self.buffer_size}")
        if (not self.batch_size and self.batch_rule == "noise" and not self.noise_scale_interval
                and not self.deterministic and not self.resume):  # a resume's batch is in its config.json
            raise ConfigError("--batch-rule noise re-decides the batch from the gradient noise scale the learner "
                              "measures: with --noise-scale-interval 0 give --batch-rule knee or a --batch-size")
        if self.learning_starts > self.buffer_size:
            raise ConfigError(f"--learning-starts {self.learning_starts} is larger than --buffer-size {self.buffer_size}")
        if self.target_return is not None and not math.isfinite(self.target_return):
            raise ConfigError(f"--target-return must be a finite number, got {self.target_return}")
        if self.num_envs and not self.deterministic:
            raise ConfigError("--num-envs needs --deterministic (free-running samplers own --envs-per-sampler envs each)")
        if self.deterministic and self.collect_per_update == 0:
            raise ConfigError("--deterministic needs a collect:update ratio: --collect-per-update must not be 0")
        if self.deterministic and self.n_step != 1:
            raise ConfigError("--deterministic writes one row per env step into fixed slots: it needs --n-step 1")
        if self.deterministic and self.lr_schedule != "constant" and not self.total_steps:
            raise ConfigError("--deterministic --lr-schedule linear follows env steps only: it needs --total-steps")
        if self.deterministic and self.resume:
            raise ConfigError("--resume cannot continue a --deterministic run (its rounds would not replay the same)")
        if self.active_envs:
            fillable = self.region_capacity * self.active_envs
            if self.region_capacity < 1:
                raise ConfigError(f"--buffer-size {self.buffer_size} is smaller than the {self.active_envs} envs that write it")
            if self.learning_begins_at > fillable:
                raise ConfigError(f"the warm-up needs {self.learning_begins_at:,} transitions but the {self.active_envs} active "
                                  f"envs can hold only {fillable:,} of --buffer-size {self.buffer_size:,}; lower "
                                  "--learning-starts/--batch-size or raise --buffer-size")
            if not self.deterministic and self.region_capacity < self.write_block + self.n_step - 1:
                raise ConfigError(f"--write-block {self.write_block} (+ --n-step - 1) is larger than one env's share "
                                  f"of the replay ({self.region_capacity} slots); lower it or raise --buffer-size")
        if self.deterministic and self.total_envs and self.buffer_size // self.total_envs < 2 * self.steps_per_round:
            raise ConfigError(f"--deterministic needs --buffer-size of at least {2 * self.steps_per_round * self.total_envs} "
                              f"(two rounds of {self.steps_per_round} steps for each of {self.total_envs} envs)")
        if self.replay_mirror == "on" and self.experience_transport != "shm":
            raise ConfigError("--replay-mirror on needs --experience-transport shm (it copies the shared replay)")
        if self.save_replay and self.experience_transport != "shm":
            raise ConfigError("--save-replay needs --experience-transport shm")
        if self.experience_transport == "queue" and (self.serial or self.deterministic or self.collect_per_update != 0):
            # a sampler blocked on a full queue stops counting env steps, so a learner held back by the ratio
            # would never drain it: the ablation runs free, in processes
            raise ConfigError("--experience-transport queue needs --collect-per-update 0 and no --serial or --deterministic")
        self._validate_ray()
        if self.wandb:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("--wandb needs Weights & Biases, which is not installed: pip install 'spreeze[wandb]'"
                                  " (or pip install wandb)")
        for name in ("actor_device", "critic_device"):
            value = getattr(self, name)
            if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
                raise ConfigError(f"--{flag_name(name)} must be auto, cpu, cuda or cuda:N, not {value!r}")
        parse_env_kwargs(self.env_kwargs)
        for spec in self.wrapper:
            module, _, attr = spec.partition(":")
            if not (all(part.isidentifier() for part in module.split("."))
                    and all(part.isidentifier() for part in attr.split("."))):
                raise ConfigError(f"--wrapper must be module:callable (say gymnasium.wrappers:TimeAwareObservation), not {spec!r}")

    def _validate_ray(self) -> None:
        """--ray places samplers on a cluster: free-running, in processes, through the shared replay only."""
        if not self.ray:
            if self.remote_samplers or self.remote_only:
                flag = "--remote-samplers" if self.remote_samplers else "--remote-only"
                raise ConfigError(f"{flag} needs --ray ADDRESS (auto, host:port or ray://host:port)")
            return
        if self.remote_only and self.samplers:
            raise ConfigError(f"--remote-only runs no local sampler process: drop --samplers {self.samplers}")
        if self.deterministic:
            raise ConfigError("--deterministic stays on this machine: it cannot run with --ray")
        if self.serial or self.experience_transport != "shm":
            raise ConfigError("--ray needs sampler processes and the shared replay: no --serial, "
                              "--experience-transport shm")
        if not re.fullmatch(r"auto|(ray://)?[^\s:/]+:\d{1,5}", self.ray):
            raise ConfigError(f"--ray must be auto, host:port or ray://host:port, not {self.ray!r}")
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("--ray needs Ray, which is not installed: pip install 'spreeze[ray]' "
                              "(or pip install -r requirements-ray.txt)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        known = {f.name for f in dataclasses.fields(cls)}
        lists = {name for name, kind in typing.get_type_hints(cls).items() if typing.get_origin(kind) is tuple}
        # JSON has no tuples: the list fields come back as lists
        return cls(**{k: tuple(v) if k in lists else v for k, v in values.items() if k in known})


_FLOAT_FIELDS = tuple(name for name, kind in typing.get_type_hints(Config).items() if kind is float)


def collect_ratio(collect_per_update: float, batch_size: int, replay_ratio: float) -> float:
    """Env steps per critic update: as given, or for -1 ``batch / replay_ratio`` so that a larger batch
    (set by hand or by the autotuner) is fed proportionally more data instead of reusing the same."""
    if collect_per_update >= 0:
        return float(collect_per_update)
    return max(batch_size, 1) / replay_ratio


# --deterministic: settings that shape the learning curve default to constants, never to the machine's
# profile (Cleanba: the hardware changes the speed, not the curve); the tuner only picks the sampler count
DETERMINISTIC_NUM_ENVS = 8
DETERMINISTIC_BATCH_SIZE = 256
