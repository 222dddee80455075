"""`LeanSGD`: torch's SGD with momentum buffers in bfloat16, widened one at a time."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.sgd import sgd

from containers.optim.lean import load_keeping_dtypes, moment_dtype_of
from containers.update.forms import check_moment_dtype

__all__ = ["LeanSGD"]


class LeanSGD(torch.optim.SGD):
    """`torch.optim.SGD` with `moment_dtype` ("float32" or "bfloat16") per group."""

    def __init__(self, params: Any, *args: Any, moment_dtype: str = "float32", **kwargs: Any):
        check_moment_dtype({"moment_dtype": moment_dtype}, "LeanSGD")
        self._moment_dtype = moment_dtype  # before torch's constructor adds the groups
        super().__init__(params, *args, **kwargs)
        self.defaults["moment_dtype"] = moment_dtype

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("moment_dtype", self._moment_dtype)
        check_moment_dtype(param_group, "LeanSGD")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        lean = [
            g for g in self.param_groups if g["momentum"] and moment_dtype_of(g) != torch.float32
        ]
        if not lean:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor | None] = []
            sparse = self._init_group(group, params, grads, buffers)
            settings = dict(
                weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"],
                maximize=group["maximize"],
            )  # fmt: skip
            if not any(group is g for g in lean):  # as torch's `SGD.step` runs it
                sgd(
                    params, grads, buffers, has_sparse_grad=sparse, foreach=group["foreach"],
                    fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                    found_inf=getattr(self, "found_inf", None), **settings,
                )  # fmt: skip
                if group["momentum"]:
                    for p, buf in zip(params, buffers):
                        self.state[p]["momentum_buffer"] = buf
                continue
            dtype = moment_dtype_of(group)
            for p, g, buf in zip(params, grads, buffers):
                wide = [None if buf is None else buf.to(p.dtype)]
                sgd([p], [g], wide, has_sparse_grad=g.is_sparse, foreach=False, **settings)
                (new,) = wide  # torch's sgd makes the first buffer
                kept = new.to(dtype) if buf is None else buf.copy_(new)  # type: ignore[union-attr]
                self.state[p]["momentum_buffer"] = kept
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_keeping_dtypes(self, state_dict, ("momentum_buffer",), super().load_state_dict)
