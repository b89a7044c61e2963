"""The shipped accelerate configs (recipes/accelerate/*.yaml) parse the way `accelerate launch` parses them.

This checks how accelerate's own launcher reads each file: the intended distributed mode, and (FSDP) the
plugin built from the environment the launcher hands the workers. ddp.yaml and fsdp.yaml also run for
real on 2 CPU processes in tests/test_fsdp_cpu.py; 1gpu.yaml and deepspeed-zero3.yaml need a GPU (and
deepspeed).
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {  # file → (fsdp, deepspeed, multi_gpu, processes)
    "1gpu.yaml": (False, False, False, 1),
    "ddp.yaml": (False, False, True, 8),
    "fsdp.yaml": (True, False, False, 8),
    "deepspeed-zero3.yaml": (False, True, False, 8),
}


def launch_args(name: str):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    argv = ["--config_file", str(ROOT / "recipes" / "accelerate" / name),
            "-m", "attnkit.finetune", "--config", str(ROOT / "recipes" / "heal-mla.yaml")]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    return args


def test_every_shipped_config_is_covered():
    assert sorted(p.name for p in (ROOT / "recipes" / "accelerate").glob("*.yaml")) == sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_launcher_resolves_the_intended_mode(name):
    args = launch_args(name)
    assert (args.use_fsdp, args.use_deepspeed, args.multi_gpu, args.num_processes) == CONFIGS[name]
    assert args.mixed_precision == "bf16" and not args.cpu
    assert args.module and args.training_script == "attnkit.finetune"


def test_fsdp_plugin_builds_from_the_launch_environment():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    env = prepare_multi_gpu_env(launch_args("fsdp.yaml"))
    with mock.patch.dict(os.environ, env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True and plugin.activation_checkpointing
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
