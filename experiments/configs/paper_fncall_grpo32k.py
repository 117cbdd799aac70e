"""The vanilla multi-turn GRPO baseline of the CodeGym setup: the context grows to 32K."""
import dataclasses

from paper_fncall_supo import config as supo_config


def config():
    cfg = supo_config()
    return dataclasses.replace(
        cfg, context=dataclasses.replace(cfg.context, manager="full", working_context=32768),
        train=dataclasses.replace(cfg.train, run_dir="runs/paper_fncall_grpo32k"))
