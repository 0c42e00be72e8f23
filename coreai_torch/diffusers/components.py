"""The components of the supported diffusers pipelines: which modules are exported, as what
(the ``torch`` wrapper traced, the example inputs, the inputs' and outputs' names), and the
pipeline families that group them.

Names and IO follow the diffusion bundles the Swift ``CoreAIDiffusionPipeline`` loads
(``metadata.json`` roles ``text_encoder``, ``text_encoder_2``, ``unet`` / ``transformer``,
``vae_decoder``, ``vae_encoder``; every asset's function is ``main``):

* ``text_encoder`` (SD): ``input_ids`` int32 [1, L] -> ``last_hidden_state``;
* ``text_encoder`` / ``text_encoder_2`` (SDXL, SD3): ``input_ids`` -> ``hidden_embeds``
  (and ``pooled_outputs`` where the pipeline reads a pooled projection);
* ``text_encoder_3`` (SD3's T5): ``input_ids`` int32 [1, L] -> ``last_hidden_state``;
* ``unet``: ``sample`` [2, C, h, w], ``timestep`` float32 [2], ``encoder_hidden_states``
  (SDXL also ``text_embeds``, ``time_ids``) -> ``noise_pred``;
* ``transformer`` (SD3's MMDiT): ``sample``, ``timestep``, ``encoder_hidden_states``,
  ``pooled_projections`` -> ``noise_pred``;
* ``transformer`` (FLUX.1, batch 1, packed latents): ``hidden_states``,
  ``encoder_hidden_states``, ``pooled_projections``, ``timestep`` (divided by 1000, as the
  pipeline passes it), ``guidance`` (guidance-distilled models), ``rotary_emb_cos``,
  ``rotary_emb_sin`` (the rotary tables, ``[text + image tokens, head dim]``, computed on the
  host) -> ``output``, as Apple's FLUX.2 exporter names them;
* ``vae_decoder``: ``z`` [1, C, h, w] (divided by the scaling factor, shifted) -> ``image``
  in [-1, 1]; ``vae_encoder``: ``image`` [1, 3, H, W] in [-1, 1] -> ``latent_params`` (mean
  and log-variance).

``hidden_embeds`` is the hidden state the pipeline reads (the penultimate layer's for SDXL and
SD3), so a program computes exactly what diffusers feeds its denoiser.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

#: the denoiser's batch: the unconditional and the conditional prompt (classifier-free guidance)
GUIDANCE_BATCH = 2


# ------------------------------------------------------------------------ traced wrappers ---


class TextEncoderModule(nn.Module):
    """``input_ids -> outputs``: the last hidden state, the penultimate one (``layer=-2``)
    and/or the pooled projection, as the pipeline reads them."""

    def __init__(self, model: nn.Module, outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.outputs = outputs

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids.long(), output_hidden_states="hidden_embeds" in self.outputs)
        found = {
            "last_hidden_state": lambda: out.last_hidden_state,
            "hidden_embeds": lambda: out.hidden_states[-2],
            "pooled_outputs": lambda: (
                out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
            ),
        }
        return tuple(found[name]() for name in self.outputs)


class UNetModule(nn.Module):
    """``(sample, timestep, encoder_hidden_states[, text_embeds, time_ids][, down_block_res_0..,
    mid_block_res]) -> noise_pred``: SDXL's added conditions and a ControlNet's residuals
    (the UNet of a ControlNet pipeline) when asked for."""

    def __init__(
        self, unet: nn.Module, added_conditions: bool = False, residuals: bool = False
    ) -> None:
        super().__init__()
        self.unet = unet
        self.added_conditions = added_conditions
        self.residuals = residuals

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *extra: torch.Tensor,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self.added_conditions:
            kwargs["added_cond_kwargs"] = {"text_embeds": extra[0], "time_ids": extra[1]}
            extra = extra[2:]
        if self.residuals:
            kwargs["down_block_additional_residuals"] = extra[:-1]
            kwargs["mid_block_additional_residual"] = extra[-1]
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0]


class ControlNetModule(nn.Module):
    """``(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale) ->
    (down_block_res_0.., mid_block_res)``."""

    def __init__(self, controlnet: nn.Module) -> None:
        super().__init__()
        self.controlnet = controlnet

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor,
        conditioning_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        down, mid = self.controlnet(
            sample,
            timestep,
            encoder_hidden_states,
            controlnet_cond,
            conditioning_scale=conditioning_scale,
            return_dict=False,
        )
        return (*down, mid)


def residual_shapes(config: dict[str, Any], height: int, width: int) -> list[tuple[int, ...]]:
    """The ``[channels, height, width]`` of each down-block residual of a UNet (or ControlNet)
    configuration at a latent size, then the mid block's."""
    channels = list(config["block_out_channels"])
    layers = config.get("layers_per_block", 2)
    shapes = [(channels[0], height, width)]
    for index, out in enumerate(channels):
        count = layers if isinstance(layers, int) else layers[index]
        shapes += [(out, height, width)] * count
        if index < len(channels) - 1:
            height, width = (height + 1) // 2, (width + 1) // 2
            shapes.append((out, height, width))
    return [*shapes, (channels[-1], height, width)]


def residual_names(config: dict[str, Any]) -> tuple[str, ...]:
    """``down_block_res_0 .. down_block_res_{n-1}, mid_block_res`` of a UNet configuration."""
    count = len(residual_shapes(config, 8, 8)) - 1
    return (*(f"down_block_res_{i}" for i in range(count)), "mid_block_res")


class SD3TransformerModule(nn.Module):
    """``(sample, timestep, encoder_hidden_states, pooled_projections) -> noise_pred``."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
    ) -> torch.Tensor:
        return self.transformer(
            hidden_states=sample,
            timestep=timestep,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            return_dict=False,
        )[0]


class HostRotary(nn.Module):
    """Stands in for a FLUX transformer's rotary position embedding (``pos_embed``), which
    computes its tables in float64 from the position ids on every call: it returns, call by
    call, the tables the traced wrapper was given as inputs (:func:`rotary_tables` computes
    them on the host, as diffusers does)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.tables:
            raise RuntimeError("the rotary tables are inputs of the exported FLUX transformer")
        return self.tables.pop(0)


class FluxTransformerModule(nn.Module):
    """``(hidden_states, encoder_hidden_states[, pooled_projections], timestep[, guidance],
    rotary_emb_cos, rotary_emb_sin) -> output``: a ``FluxTransformer2DModel`` (FLUX.1, with
    the pooled projection) or ``Flux2Transformer2DModel`` whose rotary embedding is given as
    ``[text + image tokens, head dim]`` tables (its ``pos_embed`` is replaced by
    :class:`HostRotary`: FLUX.1 calls it once on the text then image ids, FLUX.2 on the image
    ids, then on the text ids)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        config: Any = transformer.config
        self.guidance = bool(config.get("guidance_embeds"))
        self.pooled = "pooled_projection_dim" in config
        self.axes = len(config["axes_dims_rope"])
        self.rotary = HostRotary()
        transformer.pos_embed = self.rotary

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *rest: torch.Tensor,
    ) -> torch.Tensor:
        given = list(rest)
        options = {"pooled_projections": given.pop(0)} if self.pooled else {}
        timestep = given.pop(0)
        guidance = given.pop(0) if self.guidance else None
        cos, sin = given
        text = encoder_hidden_states.shape[1]
        if self.pooled:
            self.rotary.tables = [(cos, sin)]
        else:
            self.rotary.tables = [(cos[text:], sin[text:]), (cos[:text], sin[:text])]
        try:
            return self.transformer(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                timestep=timestep,
                # the ids only feed pos_embed, whose tables are given
                img_ids=hidden_states.new_zeros(hidden_states.shape[1], self.axes),
                txt_ids=hidden_states.new_zeros(text, self.axes),
                guidance=guidance,
                return_dict=False,
                **options,
            )[0]
        finally:
            self.rotary.tables = []


def rotary_tables(
    config: Mapping[str, Any], txt_ids: torch.Tensor, img_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` rotary tables of a FLUX transformer of ``config`` for the text and
    image position ids, ``[text + image tokens, head dim]`` float32: diffusers' own
    ``FluxPosEmbed`` (FLUX.1) or ``Flux2PosEmbed`` (a configuration with ``rope_theta``),
    float64 frequencies, run on the host."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    axes = list(config["axes_dims_rope"])
    ids = torch.cat([txt_ids.reshape(-1, len(axes)), img_ids.reshape(-1, len(axes))]).float()
    if "rope_theta" in config:
        embed: nn.Module = Flux2PosEmbed(theta=config["rope_theta"], axes_dim=axes)
    else:
        embed = FluxPosEmbed(theta=10000, axes_dim=axes)
    cos, sin = embed(ids)
    return cos.float(), sin.float()


def packed_image_ids(latent_height: int, latent_width: int, axes: int = 3) -> torch.Tensor:
    """The position ids of FLUX's packed latents (2x2 patches), as the FLUX pipelines make
    them: ``[tokens, axes]`` with the patch row and column in columns 1 and 2 (FLUX.2's
    fourth column, the layer, is 0)."""
    rows, columns = latent_height // 2, latent_width // 2
    ids = torch.zeros(rows, columns, axes)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(columns)[None, :]
    return ids.reshape(rows * columns, axes)


def text_ids(length: int, axes: int) -> torch.Tensor:
    """The text position ids of the FLUX pipelines: zeros (FLUX.1), the token index in the
    last column (FLUX.2)."""
    ids = torch.zeros(length, axes)
    if axes == 4:
        ids[:, 3] = torch.arange(length)
    return ids


class LayersTextEncoderModule(nn.Module):
    """``(input_ids, attention_mask) -> hidden_states``: the hidden states of ``layers`` of a
    decoder-only text encoder (FLUX.2's Qwen3), concatenated along channels as the pipeline
    stacks them (``[1, L, len(layers) * hidden]``); the language-model head is not run."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        base = getattr(self.model, "model", self.model)
        out = base(
            input_ids=input_ids.long(),
            attention_mask=attention_mask.long(),
            output_hidden_states=True,
            use_cache=False,
        )
        stacked = torch.stack([out.hidden_states[k] for k in self.layers], dim=1)
        batch, count, length, hidden = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(batch, length, count * hidden)


class VAEDecoderModule(nn.Module):
    """``z -> image``: the latents (divided by the scaling factor, shifted) decoded."""

    def __init__(self, vae: AutoencoderKL) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z, return_dict=False)[0]


class VAEEncoderModule(nn.Module):
    """``image -> latent_params``: the mean and log-variance of the latent distribution."""

    def __init__(self, vae: AutoencoderKL) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(image, return_dict=False)[0].parameters


# ---------------------------------------------------------------------------- components ---


@dataclass(frozen=True)
class Shapes:
    """What the example inputs of a component depend on: the latent size of one resolution
    and the sizes of the pipeline's other components."""

    height: int  # image pixels
    width: int
    latent_height: int
    latent_width: int
    configs: dict[str, Any]  # source name -> its config
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Component:
    """One exported component: ``role`` in the bundle, ``source`` the pipeline's module
    (its subfolder), ``asset`` the ``.aimodel`` name; ``wrap`` builds the traced module from
    the source module, ``example`` its example inputs for one resolution."""

    role: str
    source: str
    asset: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    wrap: Callable[[nn.Module], nn.Module]
    example: Callable[[Shapes], tuple[torch.Tensor, ...]]
    per_resolution: bool = False  # one entry point per exported resolution
    compressible: bool = True  # the VAE stays uncompressed (small and sensitive)
    optional: bool = False  # exported when the pipeline has the module (T5, the VAE encoder)
    #: a ControlNet's down- and mid-block residuals: taken as "inputs" (the UNet of a
    #: ControlNet pipeline) or returned as "outputs" (the ControlNet); named from the config
    residuals: str = ""
    #: the layers whose hidden states a text encoder returns (FLUX.2's Qwen3)
    layers: tuple[int, ...] = ()


def _text_length(shapes: Shapes, source: str) -> int:
    return int(shapes.extras.get(f"{source}_length", 77))


def _text_ids(source: str) -> Callable[[Shapes], tuple[torch.Tensor, ...]]:
    return lambda s: (torch.zeros(1, _text_length(s, source), dtype=torch.int32),)


def _latents(s: Shapes, source: str, batch: int) -> torch.Tensor:
    channels = s.configs[source]["in_channels"]
    return torch.randn(batch, channels, s.latent_height, s.latent_width)


def _timestep() -> torch.Tensor:
    return torch.full((GUIDANCE_BATCH,), 999.0)


def _unet_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    config = s.configs["unet"]
    context = torch.randn(GUIDANCE_BATCH, s.extras["text_length"], config["cross_attention_dim"])
    args = [_latents(s, "unet", GUIDANCE_BATCH), _timestep(), context]
    if config.get("addition_embed_type") == "text_time":
        args.append(torch.randn(GUIDANCE_BATCH, s.extras["pooled_dim"]))
        time_ids = [[s.height, s.width, 0, 0, s.height, s.width]] * GUIDANCE_BATCH
        args.append(torch.tensor(time_ids, dtype=torch.float32))
    return tuple(args)


def _controlled_unet_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    shapes = residual_shapes(s.configs["unet"], s.latent_height, s.latent_width)
    residuals = tuple(torch.randn(GUIDANCE_BATCH, *shape) * 0.1 for shape in shapes)
    return (*_unet_example(s), *residuals)


def _controlnet_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    config = s.configs["controlnet"]
    context = torch.randn(GUIDANCE_BATCH, s.extras["text_length"], config["cross_attention_dim"])
    return (
        _latents(s, "controlnet", GUIDANCE_BATCH),
        _timestep(),
        context,
        torch.rand(GUIDANCE_BATCH, 3, s.height, s.width),
        torch.ones(1),
    )


def _sd3_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    config = s.configs["transformer"]
    return (
        _latents(s, "transformer", GUIDANCE_BATCH),
        _timestep(),
        torch.randn(GUIDANCE_BATCH, s.extras["text_length"], config["joint_attention_dim"]),
        torch.randn(GUIDANCE_BATCH, config["pooled_projection_dim"]),
    )


def _flux_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    config = s.configs["transformer"]
    text = s.extras["text_length"]
    axes = len(config["axes_dims_rope"])
    image_ids = packed_image_ids(s.latent_height, s.latent_width, axes)
    args = [
        torch.randn(1, image_ids.shape[0], config["in_channels"]),
        torch.randn(1, text, config["joint_attention_dim"]),
    ]
    if "pooled_projection_dim" in config:
        args.append(torch.randn(1, config["pooled_projection_dim"]))
    args.append(torch.full((1,), 0.999))
    if config.get("guidance_embeds"):
        args.append(torch.full((1,), 3.5))
    return (*args, *rotary_tables(config, text_ids(text, axes), image_ids))


def _layers_text_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    length = _text_length(s, "text_encoder")
    mask = torch.zeros(1, length, dtype=torch.int32)
    mask[:, : max(1, length // 2)] = 1  # a padded prompt
    return torch.zeros(1, length, dtype=torch.int32), mask


def _decoder_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    channels = s.configs["vae"]["latent_channels"]
    return (torch.randn(1, channels, s.latent_height, s.latent_width),)


def _encoder_example(s: Shapes) -> tuple[torch.Tensor, ...]:
    return (torch.rand(1, 3, s.height, s.width) * 2 - 1,)


def text_encoder(role: str, source: str, asset: str, outputs: tuple[str, ...]) -> Component:
    """A text encoder exported for a batch of one prompt."""
    return Component(
        role,
        source,
        asset,
        ("input_ids",),
        outputs,
        lambda m: TextEncoderModule(m, outputs),
        _text_ids(source),
        optional=role == "text_encoder_3",
    )


VAE_DECODER = Component(
    "vae_decoder",
    "vae",
    "VAEDecoder",
    ("z",),
    ("image",),
    VAEDecoderModule,
    _decoder_example,
    per_resolution=True,
    compressible=False,
)
VAE_ENCODER = Component(
    "vae_encoder",
    "vae",
    "VAEEncoder",
    ("image",),
    ("latent_params",),
    VAEEncoderModule,
    _encoder_example,
    per_resolution=True,
    compressible=False,
    optional=True,
)


@dataclass(frozen=True)
class Family:
    """A kind of pipeline: the diffusers classes it covers (text-to-image first, then the
    image-to-image one), the bundle's ``diffusion.type`` and its components."""

    bundle_type: str
    pipelines: tuple[str, ...]
    image_to_image: str  # "" when the family's image= is not image-to-image (FLUX.2)
    denoiser: str  # the source of the denoiser: "unet" or "transformer"
    components: tuple[Component, ...]
    #: diffusers' default steps and guidance for the bundle
    default_steps: int = 50
    default_guidance_scale: float = 7.5
    #: the denoiser's batch: 2 for classifier-free guidance, 1 for guidance-distilled models
    denoiser_batch: int = GUIDANCE_BATCH
    #: latents packed into tokens of ``packing x packing`` patches by the pipeline (FLUX: 2)
    packing: int = 1
    #: the denoiser's latent size when its configuration has no ``sample_size``
    default_sample_size: int = 64
    #: the text encoder padded to ``max_sequence_length`` tokens (T5; FLUX.2's Qwen3) and
    #: the default of that length
    padded_source: str = "text_encoder_3"
    max_sequence_length: int = 256
    #: the denoiser's text tokens: the CLIP ones, the CLIP then T5 ones, or the padded ones
    text_tokens: str = "clip"


STABLE_DIFFUSION = Family(
    "stable-diffusion",
    ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"),
    "StableDiffusionImg2ImgPipeline",
    "unet",
    (
        text_encoder("text_encoder", "text_encoder", "TextEncoder", ("last_hidden_state",)),
        Component(
            "unet",
            "unet",
            "Unet",
            ("sample", "timestep", "encoder_hidden_states"),
            ("noise_pred",),
            UNetModule,
            _unet_example,
            per_resolution=True,
        ),
        VAE_DECODER,
        VAE_ENCODER,
    ),
)

STABLE_DIFFUSION_XL = Family(
    "stable-diffusion-xl",
    ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"),
    "StableDiffusionXLImg2ImgPipeline",
    "unet",
    (
        text_encoder("text_encoder", "text_encoder", "TextEncoder", ("hidden_embeds",)),
        text_encoder(
            "text_encoder_2", "text_encoder_2", "TextEncoder2", ("hidden_embeds", "pooled_outputs")
        ),
        Component(
            "unet",
            "unet",
            "Unet",
            ("sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"),
            ("noise_pred",),
            lambda m: UNetModule(m, added_conditions=True),
            _unet_example,
            per_resolution=True,
        ),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    default_guidance_scale=5.0,
)

STABLE_DIFFUSION_3 = Family(
    "stable-diffusion-3",
    ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline"),
    "StableDiffusion3Img2ImgPipeline",
    "transformer",
    (
        text_encoder(
            "text_encoder", "text_encoder", "TextEncoder", ("hidden_embeds", "pooled_outputs")
        ),
        text_encoder(
            "text_encoder_2", "text_encoder_2", "TextEncoder2", ("hidden_embeds", "pooled_outputs")
        ),
        text_encoder("text_encoder_3", "text_encoder_3", "TextEncoder3", ("last_hidden_state",)),
        Component(
            "transformer",
            "transformer",
            "MMDiT",
            ("sample", "timestep", "encoder_hidden_states", "pooled_projections"),
            ("noise_pred",),
            SD3TransformerModule,
            _sd3_example,
            per_resolution=True,
        ),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    default_steps=28,
    default_guidance_scale=7.0,
    text_tokens="clip+t5",
)


def _controlled_unet() -> Component:
    return Component(
        "unet",
        "unet",
        "Unet",
        ("sample", "timestep", "encoder_hidden_states"),
        ("noise_pred",),
        lambda m: UNetModule(m, residuals=True),
        _controlled_unet_example,
        per_resolution=True,
        residuals="inputs",
    )


STABLE_DIFFUSION_CONTROLNET = Family(
    "stable-diffusion",
    ("StableDiffusionControlNetPipeline", "StableDiffusionControlNetImg2ImgPipeline"),
    "StableDiffusionControlNetImg2ImgPipeline",
    "unet",
    (
        STABLE_DIFFUSION.components[0],
        _controlled_unet(),
        Component(
            "controlnet",
            "controlnet",
            "ControlNet",
            (
                "sample",
                "timestep",
                "encoder_hidden_states",
                "controlnet_cond",
                "conditioning_scale",
            ),
            (),  # the residuals, named from the configuration (component_io)
            ControlNetModule,
            _controlnet_example,
            per_resolution=True,
            residuals="outputs",
        ),
        VAE_DECODER,
        VAE_ENCODER,
    ),
)


def flux_transformer(pooled: bool) -> Component:
    """A FLUX transformer: FLUX.1's takes the pooled CLIP projection, FLUX.2's does not (the
    ``guidance`` input only when the model has a guidance embedding, see
    :func:`component_io`)."""
    return Component(
        "transformer",
        "transformer",
        "Transformer",
        (
            "hidden_states",
            "encoder_hidden_states",
            *(("pooled_projections",) if pooled else ()),
            "timestep",
            "guidance",
            "rotary_emb_cos",
            "rotary_emb_sin",
        ),
        ("output",),
        FluxTransformerModule,
        _flux_example,
        per_resolution=True,
    )


#: what the FLUX families share: a batch-1 transformer on 2x2-packed latents, 512 text tokens
_FLUX_SHAPES: dict[str, Any] = dict(
    denoiser_batch=1,
    packing=2,
    default_sample_size=128,
    max_sequence_length=512,
    text_tokens="padded",
)

#: FLUX.1 (guidance-distilled or not): no bundle type of the Swift pipeline covers it
FLUX = Family(
    "flux",
    ("FluxPipeline", "FluxImg2ImgPipeline"),
    "FluxImg2ImgPipeline",
    "transformer",
    (
        text_encoder("text_encoder", "text_encoder", "TextEncoder", ("pooled_outputs",)),
        text_encoder("text_encoder_2", "text_encoder_2", "TextEncoder2", ("last_hidden_state",)),
        flux_transformer(pooled=True),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    default_steps=28,
    default_guidance_scale=3.5,
    padded_source="text_encoder_2",
    **_FLUX_SHAPES,
)

#: the layers of FLUX.2 [klein]'s Qwen3 text encoder the pipeline reads (its default
#: ``text_encoder_out_layers``)
FLUX2_TEXT_LAYERS = (9, 18, 27)

#: FLUX.2 [klein] (Qwen3 text encoder); image= gives it reference images, not exported
FLUX2 = Family(
    "flux2",
    ("Flux2KleinPipeline",),
    "",
    "transformer",
    (
        Component(
            "text_encoder",
            "text_encoder",
            "TextEncoder",
            ("input_ids", "attention_mask"),
            ("hidden_states",),
            lambda m: LayersTextEncoderModule(m, FLUX2_TEXT_LAYERS),
            _layers_text_example,
            layers=FLUX2_TEXT_LAYERS,
        ),
        flux_transformer(pooled=False),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    default_steps=50,
    default_guidance_scale=4.0,
    padded_source="text_encoder",
    **_FLUX_SHAPES,
)

FAMILIES = (
    STABLE_DIFFUSION,
    STABLE_DIFFUSION_XL,
    STABLE_DIFFUSION_3,
    STABLE_DIFFUSION_CONTROLNET,
    FLUX,
    FLUX2,
)


def component_io(component: Component, configs: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """The input and output names of ``component`` in a pipeline of ``configs``: a ControlNet
    pipeline's UNet also takes, and its ControlNet returns, the down- and mid-block residuals."""
    inputs, outputs = component.inputs, component.outputs
    if component.residuals == "inputs":
        inputs = (*inputs, *residual_names(configs[component.source]))
    if component.residuals == "outputs":
        outputs = residual_names(configs[component.source])
    if "guidance" in inputs and not configs[component.source].get("guidance_embeds"):
        inputs = tuple(name for name in inputs if name != "guidance")
    return inputs, outputs


def family_of(pipeline_class: str) -> Family | None:
    """The family that exports ``pipeline_class`` (a diffusers class name), or None."""
    for family in FAMILIES:
        if pipeline_class in family.pipelines:
            return family
    return None


def family_named(bundle_type: str) -> Family:
    """The family of a bundle's ``diffusion.type``."""
    for family in FAMILIES:
        if family.bundle_type == bundle_type:
            return family
    raise ValueError(
        f"unknown diffusion type '{bundle_type}' (known: "
        f"{', '.join(f.bundle_type for f in FAMILIES)})"
    )


def supported_pipelines() -> list[str]:
    """Every diffusers pipeline class that :func:`family_of` knows."""
    return [name for family in FAMILIES for name in family.pipelines]
