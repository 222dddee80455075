"""`LeanAdam` and `LeanAdamW`: torch's Adam and AdamW with moments in any codec of
`containers.update.forms` (bfloat16, 8-bit or 4-bit codes: 4, 2.25 or 1.25 bytes a
parameter). Each group's plan is made when it is added or loaded, and a load keeps its
`moment_dtype`; a lean group always uses the fused kernel (an unset `fused` becomes True,
which also decides where `step` lives).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype

from containers.optim.lean import load_keeping_dtypes
from containers.update.codecs import RowCodes
from containers.update.driver import MOMENTS, step_adam
from containers.update.forms import CODED, MOMENT_CODECS, check_moment_dtype
from containers.update.plan import Plan, plan_of

__all__ = ["LeanAdam", "LeanAdamW"]


class _Lean:
    """What `LeanAdam` and `LeanAdamW` add to torch's classes (a mixin placed before them)."""

    converts_codes = True  # its load takes moments as 8-bit codes or tensors, either way

    def __init__(
        self,
        params: Any,
        *args: Any,
        moment_dtype: str = "float32",
        compiled: bool = False,
        **kwargs: Any,
    ):
        check_moment_dtype({"moment_dtype": moment_dtype}, type(self).__name__, codes=True)
        # Set before torch's constructor adds the groups, so each takes the default.
        self._moment_dtype, self._compiled = moment_dtype, compiled
        self.plans: dict[int, Plan] = {}  # id(group) -> its plan
        super().__init__(params, *args, **kwargs)  # type: ignore[call-arg]
        self.defaults |= {"moment_dtype": moment_dtype, "compiled": compiled}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As torch's (a pickle or deepcopy keeps defaults, state and groups), the plans made
        again from the groups."""
        super().__setstate__(state)  # type: ignore[misc]
        self._moment_dtype = self.defaults["moment_dtype"]  # type: ignore[attr-defined]
        self._compiled = self.defaults["compiled"]  # type: ignore[attr-defined]
        self.plans = {id(g): plan_of(type(self), g) for g in self.param_groups}  # type: ignore[arg-type, attr-defined]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("moment_dtype", self._moment_dtype)
        param_group.setdefault("compiled", self._compiled)
        name = type(self).__name__
        check_moment_dtype(param_group, name, codes=True)
        amsgrad = param_group.get("amsgrad", self.defaults["amsgrad"])  # type: ignore[attr-defined]
        if param_group["compiled"] and amsgrad:
            raise ValueError(
                f"{name}: compiled = True with amsgrad = True: the compiled step is Adam's and "
                "AdamW's without amsgrad; set compiled = False"
            )
        moments = param_group["moment_dtype"]
        if amsgrad and moments in CODED:
            raise ValueError(
                f"{name}: moment_dtype = {moments!r} with amsgrad = True: the codes are of "
                "exp_avg and exp_avg_sq; set amsgrad = False or moment_dtype = 'bfloat16'"
            )
        if moments != "float32" or param_group["compiled"]:
            params = _read_once(param_group)
            codec = MOMENT_CODECS[moments]
            if isinstance(codec, RowCodes):
                for p in params:
                    codec.announce(p)
            _refuse_strided(params, param_group, name)
            if param_group.get("fused") is None:
                param_group["fused"] = True
        super().add_param_group(param_group)  # type: ignore[misc]
        group = self.param_groups[-1]  # type: ignore[attr-defined]
        self.plans[id(group)] = plan_of(type(self), group)  # type: ignore[arg-type]

    def _init_group(
        self,
        group: dict[str, Any],
        params: list,
        grads: list,
        exp_avgs: list,
        exp_avg_sqs: list,
        max_exp_avg_sqs: list,
        steps: list,
    ) -> bool:
        """Torch's `_init_group` (arguments as torch's), new moments in the group's codec."""
        codec = MOMENT_CODECS[group["moment_dtype"]]
        dtype = codec.dtype  # torch's own makes the state where it is the parameters'
        for p in group["params"]:
            if p.grad is None or dtype == p.dtype or len(self.state[p]) != 0:  # type: ignore[attr-defined]
                continue
            # As torch hosts `step` (see its note [special device hosting for step]).
            if group["capturable"] or group["fused"]:
                step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device)
            else:
                step = torch.tensor(0.0, dtype=_get_scalar_dtype())
            names = MOMENTS[: 3 if group["amsgrad"] else 2]
            moments = {n: codec.new(n, p) for n in names}
            self.state[p] = {"step": step, **moments}  # type: ignore[attr-defined]
        lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        return super()._init_group(group, *lists)  # type: ignore[misc]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # type: ignore[attr-defined]
            lists: tuple[list, ...] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)
            if lists[0]:
                # a GradScaler's or the container's skip flag
                found_inf = getattr(self, "found_inf", None)
                plan = self.plans[id(group)]
                step_adam(plan, group, *lists, has_complex=has_complex, found_inf=found_inf)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        compiled = [g["compiled"] for g in self.param_groups]  # type: ignore[attr-defined]
        load_keeping_dtypes(self, state_dict, MOMENTS, super().load_state_dict)  # type: ignore[arg-type, misc]
        for group, own in zip(self.param_groups, compiled):  # type: ignore[attr-defined]
            group["compiled"] = own
        self.plans = {id(g): plan_of(type(self), g) for g in self.param_groups}  # type: ignore[arg-type, attr-defined]


def _read_once(group: dict[str, Any]) -> Collection[torch.Tensor]:
    """`group`'s parameters (a generator read into a list in `group`: torch reads it later)."""
    params = group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if not isinstance(params, (list, tuple, set)):
        group["params"] = params = list(params)
    return params


def _refuse_strided(params: Collection[torch.Tensor], group: dict[str, Any], name: str) -> None:
    for p in params:
        if not p.is_contiguous():
            raise ValueError(
                f"{name}: moment_dtype = {group['moment_dtype']!r}, compiled = "
                f"{group['compiled']}: a parameter of shape {tuple(p.shape)} is not contiguous "
                "(these groups step flat views); make it contiguous or use moment_dtype = "
                "'float32' without compiled"
            )


class LeanAdam(_Lean, torch.optim.Adam):
    """`torch.optim.Adam` with `moment_dtype` ("float32", "bfloat16", "8bit", "4bit") per
    group."""


class LeanAdamW(_Lean, torch.optim.AdamW):
    """`torch.optim.AdamW` with `moment_dtype` ("float32", "bfloat16", "8bit", "4bit") per
    group."""
