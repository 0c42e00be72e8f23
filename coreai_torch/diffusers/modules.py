"""Stand-ins for a pipeline's torch modules that run its exported components on the Core AI
runtime, with the interface diffusers' pipelines call (so the pipeline's own code -- tokenizing,
noise, the scheduler, guidance, image processing -- runs unchanged on the host).

Each stand-in has the source module's ``config`` and answers the attributes the pipelines read
(``dtype``, ``device``, ``config.*``); a call the exported program cannot make (a resolution
that was not exported, per-layer hidden states that were not exported, a time step that is not
one number per sample) raises a ``ValueError`` naming what to do instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn as nn

from coreai_torch.runtime import Session

if TYPE_CHECKING:
    from diffusers import ControlNetModel


class RuntimeModule(nn.Module):
    """A module whose forward runs a Core AI asset (one :class:`Session`, opened lazily)."""

    def __init__(
        self,
        asset: Any,
        config: Mapping[str, Any],
        entrypoints: Mapping[str, tuple[int, int] | None],
        *,
        verify_hash: bool = True,
    ) -> None:
        super().__init__()
        self.asset = asset
        self.entrypoints = dict(entrypoints)
        self.config = _config(config)
        self._verify_hash = verify_hash
        self._session: Session | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def session(self) -> Session:
        if self._session is None:
            session = Session(self.asset, verify_hash=self._verify_hash)
            session.open()
            self._session = session
        return self._session

    def close(self) -> None:
        """Release the runtime (reopened on the next call)."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def to(self, *args: Any, **kwargs: Any) -> RuntimeModule:
        """Stays on the CPU in float32 (the pipelines move and cast modules; the program's
        own precision was set when it was exported)."""
        return self

    def run(self, entrypoint: str, **inputs: torch.Tensor | np.ndarray) -> dict[str, torch.Tensor]:
        feeds = {
            name: np.ascontiguousarray(
                value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            )
            for name, value in inputs.items()
        }
        out = self.session.run(feeds, entrypoint=entrypoint)
        return {name: torch.from_numpy(np.array(value)) for name, value in out.items()}

    def entrypoint_for(self, height: int, width: int, what: str) -> str:
        """The entry point of the resolution whose latents (or image) are ``height x width``."""
        for name, resolution in self.entrypoints.items():
            if resolution is None or resolution == (height, width):
                return name
        exported = ", ".join(f"{h}x{w}" for h, w in self.resolutions())
        raise ValueError(
            f"the {what} was exported for {exported} (height x width) and cannot take "
            f"{height}x{width}; call the pipeline with one of those sizes, or export it again "
            f"with height={height}, width={width} (or resolutions=[...])"
        )

    def resolutions(self) -> list[tuple[int, int]]:
        return [r for r in self.entrypoints.values() if r is not None]


def _config(values: Mapping[str, Any]) -> Any:
    from diffusers.configuration_utils import FrozenDict

    return FrozenDict(values)


def batched(
    module: RuntimeModule,
    entrypoint: str,
    batch: int,
    inputs: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``entrypoint`` (exported for ``batch`` samples) over inputs of any batch size: in
    chunks of ``batch``, the last one padded with copies of its first sample (``shared``
    inputs are given whole to every chunk)."""
    total = next(iter(inputs.values())).shape[0]
    pieces: list[dict[str, torch.Tensor]] = []
    for start in range(0, total, batch):
        chunk = {k: v[start : start + batch] for k, v in inputs.items()}
        size = next(iter(chunk.values())).shape[0]
        if size < batch:
            chunk = {
                k: torch.cat([v, v[:1].expand(batch - size, *v.shape[1:])])
                for k, v in chunk.items()
            }
        out = module.run(entrypoint, **chunk, **(shared or {}))
        pieces.append({k: v[:size] for k, v in out.items()})
    return {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}


# --------------------------------------------------------------------------- text encoders --


class _HiddenStates(tuple[Any, ...]):
    """The ``hidden_states`` of a text encoder's output: only the exported layer is there."""

    known: dict[int, torch.Tensor]

    def __new__(cls, layers: int, known: Mapping[int, torch.Tensor]) -> _HiddenStates:
        self = super().__new__(cls, [None] * layers)
        self.known = dict(known)
        return self

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            position = index % len(self)
            if position in self.known:
                return self.known[position]
            raise ValueError(
                f"hidden_states[{index}] was not exported (the program returns layer(s) "
                f"{sorted(self.known)} of {len(self)}); leave clip_skip at None or export a "
                "text encoder that returns that layer"
            )
        return super().__getitem__(index)


class RuntimeTextEncoder(RuntimeModule):
    """A CLIP / T5 text encoder: ``(input_ids) -> output`` like ``transformers``' models
    (``[0]``, ``last_hidden_state``, ``hidden_states[-2]``, ``text_embeds`` /
    ``pooler_output``), run one prompt at a time."""

    def __init__(
        self,
        *args: Any,
        outputs: tuple[str, ...],
        projection: bool,
        layers: tuple[int, ...] = (),
        masked: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.outputs = outputs
        self.projection = projection  # CLIPTextModelWithProjection: [0] is text_embeds
        #: the layers whose hidden states the program returns concatenated (FLUX.2's Qwen3)
        self.layers = layers
        self.masked = masked  # the program takes the attention mask

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool = True,
        **_: Any,
    ) -> Any:
        feeds = []
        for index, row in enumerate(input_ids):
            feed = {"input_ids": row[None].to(torch.int32)}
            if self.masked:
                mask = torch.ones_like(row) if attention_mask is None else attention_mask[index]
                feed["attention_mask"] = mask[None].to(torch.int32)
            feeds.append(feed)
        rows = [self.run("main", **feed) for feed in feeds]
        out = {name: torch.cat([r[name] for r in rows]) for name in self.outputs}
        layers = int(self.config.get("num_hidden_layers", 1)) + 1
        if self.layers:
            parts = out["hidden_states"].chunk(len(self.layers), dim=-1)
            read = _HiddenStates(layers, dict(zip(self.layers, parts, strict=True)))
            return EncoderOutput((None, read), hidden_states=read)
        hidden = {layers - 2: out["hidden_embeds"]} if "hidden_embeds" in out else {}
        last = out.get("last_hidden_state")
        if last is not None:
            hidden[layers - 1] = last
        pooled = out.get("pooled_outputs")
        states = _HiddenStates(layers, hidden) if output_hidden_states else None
        token_level = last if last is not None else out.get("hidden_embeds")
        if self.projection:  # CLIPTextModelWithProjection: (text_embeds, last_hidden_state, ...)
            items: tuple = (pooled, token_level, states)
            return EncoderOutput(
                items, text_embeds=pooled, last_hidden_state=last, hidden_states=states
            )
        items = (token_level, pooled, states)  # CLIPTextModel / T5: (last_hidden_state, ...)
        return EncoderOutput(
            items, last_hidden_state=last, pooler_output=pooled, hidden_states=states
        )


class EncoderOutput(SimpleNamespace):
    """A text encoder's output: the fields by name, and by position as ``transformers``'
    outputs order them (``[0]``)."""

    def __init__(self, items: tuple, **fields: Any) -> None:
        super().__init__(**fields)
        self._items = tuple(item for item in items if item is not None)

    def __getitem__(self, index: int) -> Any:
        return self._items[index]


# --------------------------------------------------------------------------------- denoiser --


def check_timestep(timestep: Any, batch: int) -> torch.Tensor:
    """The denoiser's ``timestep`` input (float32, one per sample) from what a scheduler gives:
    a number, or a tensor of one value or one per sample."""
    t = torch.as_tensor(timestep)
    if t.dim() == 0 or (t.dim() == 1 and t.numel() == 1):
        t = t.reshape(1).expand(batch)
    elif t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(
            f"the exported denoiser takes one time step per sample ([batch]), got a time step of "
            f"shape {tuple(t.shape)}; the scheduler gives time steps this program cannot take: "
            "use a scheduler with one time step per denoising step (e.g. "
            "pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config))"
        )
    t = t.to(torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"the scheduler gave a non-finite time step {t.tolist()}")
    return t


class RuntimeDenoiser(RuntimeModule):
    """A denoiser exported for ``batch`` samples (the guidance batch) at fixed resolutions."""

    def __init__(self, *args: Any, extra: Mapping[str, Any], batch: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.batch = batch
        self.vae_scale_factor = int(extra["vae_scale_factor"])

    def entry_for_latents(self, latents: torch.Tensor, what: str) -> str:
        """The entry point of the resolution whose latents ``latents`` are."""
        factor = self.vae_scale_factor
        return self.entrypoint_for(latents.shape[-2] * factor, latents.shape[-1] * factor, what)


class RuntimeUNet(RuntimeDenoiser):
    """``UNet2DConditionModel.forward`` on the exported UNet (SD 1.x/2.x, SDXL)."""

    def __init__(
        self, *args: Any, extra: Mapping[str, Any], residuals: tuple[str, ...] = (), **kw: Any
    ) -> None:
        super().__init__(*args, extra=extra, **kw)
        #: the ControlNet residual inputs of a ControlNet pipeline's UNet (none otherwise)
        self.residuals = tuple(n for n in residuals if n.endswith("_res") or "_res_" in n)
        if "add_embedding_in_features" in extra:  # read by SDXL's _get_add_time_ids
            self.add_embedding = SimpleNamespace(
                linear_1=SimpleNamespace(in_features=extra["add_embedding_in_features"])
            )

    def forward(
        self,
        sample: torch.Tensor,
        timestep: Any,
        encoder_hidden_states: torch.Tensor,
        timestep_cond: torch.Tensor | None = None,
        cross_attention_kwargs: Any = None,
        added_cond_kwargs: Mapping[str, torch.Tensor] | None = None,
        down_block_additional_residuals: Any = None,
        mid_block_additional_residual: torch.Tensor | None = None,
        return_dict: bool = True,
        **unsupported: Any,
    ) -> Any:
        _refuse(unsupported, "UNet")
        if timestep_cond is not None or cross_attention_kwargs:
            raise ValueError(
                "the exported UNet takes no timestep_cond / cross_attention_kwargs (LoRA scales "
                "and guidance embeddings are fixed at export)"
            )
        entry = self.entry_for_latents(sample, "UNet")
        inputs = {
            "sample": sample.float(),
            "timestep": check_timestep(timestep, sample.shape[0]),
            "encoder_hidden_states": encoder_hidden_states.float(),
        }
        if added_cond_kwargs:
            inputs["text_embeds"] = added_cond_kwargs["text_embeds"].float()
            inputs["time_ids"] = added_cond_kwargs["time_ids"].float()
        given = down_block_additional_residuals is not None
        if given and not self.residuals:
            raise ValueError(
                "this UNet was exported without ControlNet residual inputs; export the "
                "StableDiffusionControlNetPipeline to run a ControlNet"
            )
        if self.residuals:
            if given:
                values = [*down_block_additional_residuals, mid_block_additional_residual]
            else:  # no ControlNet this call: residuals of zeros add nothing
                values = [None] * len(self.residuals)
            if len(values) != len(self.residuals):
                raise ValueError(
                    f"the UNet takes {len(self.residuals)} ControlNet residuals, got {len(values)}"
                )
            for name, value in zip(self.residuals, values, strict=True):
                inputs[name] = (
                    value.float() if value is not None else self._zeros(entry, name, sample)
                )
        noise = batched(self, entry, self.batch, inputs)["noise_pred"]
        return _output(noise, return_dict)

    def _zeros(self, entry: str, name: str, sample: torch.Tensor) -> torch.Tensor:
        shape = list(self.session.descriptor(entry).input_descriptor(name).shape)
        return torch.zeros(sample.shape[0], *shape[1:])


def runtime_controlnet(
    runner: RuntimeModule, extra: Mapping[str, Any], batch: int, outputs: tuple[str, ...]
) -> ControlNetModel:
    """A ``ControlNetModel`` (the pipelines check the class) whose forward runs the exported
    ControlNet: ``(sample, timestep, encoder_hidden_states, controlnet_cond,
    conditioning_scale) -> (down-block residuals, mid-block residual)``."""
    from diffusers import ControlNetModel

    class RuntimeControlNet(ControlNetModel):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self._internal_dict = runner.config
            self.runner = runner
            self.vae_scale_factor = int(extra["vae_scale_factor"])

        @property
        def dtype(self) -> torch.dtype:
            return torch.float32

        @property
        def device(self) -> torch.device:
            return torch.device("cpu")

        def to(self, *args: Any, **kwargs: Any) -> RuntimeControlNet:
            return self

        def close(self) -> None:
            runner.close()

        def forward(
            self,
            sample: torch.Tensor,
            timestep: Any,
            encoder_hidden_states: torch.Tensor,
            controlnet_cond: torch.Tensor,
            conditioning_scale: float = 1.0,
            guess_mode: bool = False,
            return_dict: bool = True,
            **unsupported: Any,
        ) -> Any:
            _refuse(unsupported, "ControlNet")
            if guess_mode:
                raise ValueError(
                    "the exported ControlNet scales its residuals uniformly; guess_mode=True "
                    "(and global_pool_conditions) is not supported"
                )
            factor = self.vae_scale_factor
            entry = runner.entrypoint_for(
                sample.shape[-2] * factor, sample.shape[-1] * factor, "ControlNet"
            )
            out = batched(
                runner,
                entry,
                batch,
                {
                    "sample": sample.float(),
                    "timestep": check_timestep(timestep, sample.shape[0]),
                    "encoder_hidden_states": encoder_hidden_states.float(),
                    "controlnet_cond": controlnet_cond.float(),
                },
                {"conditioning_scale": torch.full((1,), float(conditioning_scale))},
            )
            down = tuple(out[name] for name in outputs[:-1])
            mid = out[outputs[-1]]
            if return_dict:
                return SimpleNamespace(down_block_res_samples=down, mid_block_res_sample=mid)
            return down, mid

    return RuntimeControlNet()


class RuntimeSD3Transformer(RuntimeDenoiser):
    """``SD3Transformer2DModel.forward`` on the exported MMDiT."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        timestep: Any = None,
        joint_attention_kwargs: Any = None,
        return_dict: bool = True,
        **unsupported: Any,
    ) -> Any:
        _refuse({k: v for k, v in unsupported.items() if v is not None}, "SD3 transformer")
        entry = self.entry_for_latents(hidden_states, "SD3 transformer")
        assert encoder_hidden_states is not None and pooled_projections is not None
        noise = batched(
            self,
            entry,
            self.batch,
            {
                "sample": hidden_states.float(),
                "timestep": check_timestep(timestep, hidden_states.shape[0]),
                "encoder_hidden_states": encoder_hidden_states.float(),
                "pooled_projections": pooled_projections.float(),
            },
        )["noise_pred"]
        return _output(noise, return_dict)


class RuntimeFluxTransformer(RuntimeDenoiser):
    """``FluxTransformer2DModel.forward`` / ``Flux2Transformer2DModel.forward`` on the
    exported transformer: the rotary tables are computed on the host from the position ids
    the pipeline passes (diffusers' own position embedding), the entry point chosen by the
    image ids' grid."""

    def __init__(self, *args: Any, extra: Mapping[str, Any], inputs: tuple[str, ...], **kw: Any):
        super().__init__(*args, extra=extra, **kw)
        self.inputs = inputs

    def cache_context(self, name: str) -> contextlib.AbstractContextManager[None]:
        """diffusers' caching hooks: nothing is cached here."""
        return contextlib.nullcontext()

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        timestep: Any = None,
        img_ids: torch.Tensor | None = None,
        txt_ids: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        joint_attention_kwargs: Any = None,
        return_dict: bool = True,
        **unsupported: Any,
    ) -> Any:
        from .components import rotary_tables

        _refuse({k: v for k, v in unsupported.items() if v is not None}, "FLUX transformer")
        if joint_attention_kwargs:
            raise ValueError(
                "the exported FLUX transformer takes no joint_attention_kwargs (LoRA scales and "
                "IP-Adapter embeddings are fixed at export)"
            )
        assert encoder_hidden_states is not None
        assert img_ids is not None and txt_ids is not None
        image_ids = img_ids[0] if img_ids.dim() == 3 else img_ids
        txt_ids = txt_ids[0] if txt_ids.dim() == 3 else txt_ids
        packing = 2 * self.vae_scale_factor
        height = (int(image_ids[:, 1].max()) + 1) * packing
        width = (int(image_ids[:, 2].max()) + 1) * packing
        entry = self.entrypoint_for(height, width, "FLUX transformer")
        cos, sin = rotary_tables(self.config, txt_ids, image_ids)
        batch = hidden_states.shape[0]
        inputs = {
            "hidden_states": hidden_states.float(),
            "encoder_hidden_states": encoder_hidden_states.float(),
            "timestep": check_timestep(timestep, batch),
        }
        if "pooled_projections" in self.inputs:
            assert pooled_projections is not None
            inputs["pooled_projections"] = pooled_projections.float()
        if "guidance" in self.inputs:
            if guidance is None:
                raise ValueError("the exported FLUX transformer takes a guidance value")
            inputs["guidance"] = torch.as_tensor(guidance, dtype=torch.float32).expand(batch)
        shared = {"rotary_emb_cos": cos, "rotary_emb_sin": sin}
        noise = batched(self, entry, self.batch, inputs, shared)["output"]
        return _output(noise, return_dict)


def _refuse(arguments: Mapping[str, Any], what: str) -> None:
    given = [k for k, v in arguments.items() if v is not None and v is not False]
    if given:
        raise ValueError(
            f"the exported {what} does not take {', '.join(given)} (only the inputs it was "
            "exported with)"
        )


def _output(sample: torch.Tensor, return_dict: bool) -> Any:
    if return_dict:
        return SimpleNamespace(sample=sample)
    return (sample,)


# ---------------------------------------------------------------------------------- the VAE --


class RuntimeVAE(RuntimeModule):
    """``AutoencoderKL``'s ``decode`` / ``encode`` on the exported VAE decoder and encoder."""

    def __init__(
        self,
        decoder: Any,
        config: Mapping[str, Any],
        entrypoints: Mapping[str, tuple[int, int] | None],
        *,
        encoder: Any = None,
        statistics: tuple[torch.Tensor, torch.Tensor] | None = None,
        verify_hash: bool = True,
    ) -> None:
        super().__init__(decoder, config, entrypoints, verify_hash=verify_hash)
        self.encoder_module = (
            RuntimeModule(encoder, config, entrypoints, verify_hash=verify_hash)
            if encoder is not None
            else None
        )
        self.factor = 2 ** (len(config["block_out_channels"]) - 1)
        if statistics is not None:  # AutoencoderKLFlux2's latent batch norm, read by pipelines
            mean, var = statistics
            self.bn = SimpleNamespace(running_mean=mean, running_var=var)

    def decode(self, z: torch.Tensor, return_dict: bool = True, **_: Any) -> Any:
        height, width = z.shape[-2] * self.factor, z.shape[-1] * self.factor
        entry = self.entrypoint_for(height, width, "VAE decoder (image)")
        image = batched(self, entry, 1, {"z": z.float()})["image"]
        return _output(image, return_dict)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if self.encoder_module is None:
            raise ValueError(
                "this pipeline was exported without its VAE encoder, which image-to-image "
                "needs; export it again (the encoder is exported when the pipeline has a VAE)"
            )
        entry = self.entrypoint_for(x.shape[-2], x.shape[-1], "VAE encoder (image)")
        params = batched(self.encoder_module, entry, 1, {"image": x.float()})["latent_params"]
        dist = DiagonalGaussianDistribution(params)
        return SimpleNamespace(latent_dist=dist) if return_dict else (dist,)

    def close(self) -> None:
        super().close()
        if self.encoder_module is not None:
            self.encoder_module.close()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("call vae.decode(...) or vae.encode(...)")
