"""Devices and meshes to compile for: fake CPU devices, the devices of a named TPU
topology (libtpu), the mesh sizes, and what compiled a report."""

from __future__ import annotations

from typing import Any

import jax


# ----------------------------------------------------------------------------------------
# Fake devices and meshes
# ----------------------------------------------------------------------------------------
def configure_devices(num_devices: int | None) -> None:
    """Use ``num_devices`` fake CPU devices (must run before JAX creates its backends)."""
    if num_devices is None:
        return
    if num_devices < 1:
        raise ValueError(f"--aot-devices must be >= 1, got {num_devices}")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        have = jax.device_count()
        if jax.default_backend() == "cpu" and have == num_devices:
            return
        raise ValueError(
            f"--aot-devices {num_devices}: JAX is already running with {have} "
            f"{jax.default_backend()} device(s); set the device count before any JAX computation"
        )
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(num_devices))


# Chip families libtpu compiles for, and an example topology name of each.
TPU_TOPOLOGY_EXAMPLES = ("v5e:2x2", "v5p:2x2x1", "v5p:4x4x4", "v6e:2x2")


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def topology_devices(name: str) -> list:
    """The devices of TPU topology ``name`` (e.g. ``v5p:2x2x1``), for compiling on a host
    without TPUs. Raises a user error naming what is missing or wrong."""
    if libtpu_version() is None:
        raise ValueError(
            f"--aot-topology {name} needs libtpu, the TPU compiler: pip install -e '.[tpu]' "
            "(the version jax[tpu] pins for this jax); without it use --aot-devices N "
            "(fake CPU devices, an estimate)"
        )
    from jax.experimental import topologies

    if ":" not in name:
        raise ValueError(
            f"--aot-topology {name!r}: expected CHIP:SHAPE such as "
            f"{', '.join(TPU_TOPOLOGY_EXAMPLES)}"
        )
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # libtpu's own message names the bad chip or shape
        if "lockfile" in str(e):
            raise ValueError(
                f"--aot-topology {name!r}: another process holds libtpu's lock "
                "(/tmp/libtpu_lockfile), e.g. a second AOT compile on this host. Wait for it, "
                "or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 when no process is using real TPU chips"
            ) from None
        raise ValueError(
            f"--aot-topology {name!r} is not a TPU topology libtpu knows "
            f"(e.g. {', '.join(TPU_TOPOLOGY_EXAMPLES)}): {e}"
        ) from None
    return list(topo.devices)


def compiler_info(mesh) -> dict[str, Any]:
    """Which compiler a mesh's executables come from (recorded in every report)."""
    dev = mesh.devices.flat[0]
    platform = getattr(dev, "platform", "cpu")
    info: dict[str, Any] = {"compiler": f"XLA:{platform.upper()}", "jax": jax.__version__}
    if platform == "tpu":
        info["libtpu"] = libtpu_version()
        info["device_kind"] = getattr(dev, "device_kind", None)
    else:
        info["note"] = "fake CPU devices: temp memory is the CPU compiler's plan (an estimate)"
    return info


def parse_mesh(text: str | None, mesh_cfg=None) -> tuple[int, int, int]:
    """``"data,fsdp,tensor"`` (one may be -1) or the config's ``mesh`` section."""
    if text is None:
        if mesh_cfg is None:
            return (-1, 1, 1)
        return (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    parts = text.split(",")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3:
        raise ValueError(f"--aot-mesh must be three integers data,fsdp,tensor; got {text!r}")
    return sizes
