//! Where a rank runs: the device kinds ([`RankDevice`]), how the ranks of a node share its
//! devices, and a process's place on its node as the launcher (Open MPI, MPICH/Hydra, PMI,
//! Slurm) tells it.

use burn::tensor::Device;
use copus_core::memory::Precision;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A device this build or this process cannot give a rank.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct DeviceError(pub String);

/// The device a rank trains on. Only Flex (Burn's pure-Rust CPU backend) is built by default;
/// the others need the crate feature of the same name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankDevice {
    /// Burn's Flex CPU backend (several ranks share the machine's cores).
    #[default]
    Flex,
    /// The default wgpu adapter (feature `wgpu`).
    Wgpu,
    /// CUDA device `i` (feature `cuda`).
    Cuda(usize),
    /// ROCm device `i` (feature `rocm`).
    Rocm(usize),
    /// LibTorch (Burn's `tch` backend) on the CPU (feature `tch`).
    TchCpu,
    /// LibTorch on CUDA device `i` (feature `tch`).
    TchCuda(usize),
}

/// The device index of rank `local` of the `on_node` ranks that share a node's GPUs:
/// `local / per`, where `per` is `ranks_per_device` when given, else the fewest ranks per device
/// that fit the node's ranks on its `visible` devices (`ceil(on_node / visible)`: 8 ranks on one
/// GPU all take it, 8 on 8 take one each, 8 on 3 take 3, 3 and 2), else 1 (rank `local` on device
/// `local`, when nothing says how many devices there are).
pub fn device_index(local: usize, on_node: usize, visible: Option<usize>, ranks_per_device: Option<usize>) -> usize {
    let per = match (ranks_per_device, visible) {
        (Some(k), _) => k,
        (None, Some(v)) if v > 0 => on_node.div_ceil(v),
        (None, _) => 1,
    };
    local / per.max(1)
}

/// Where this process sits on its node, from the launcher's environment (`var` reads one
/// variable): its rank among the node's processes and how many there are, each where the
/// launcher says. Open MPI, MPICH/Hydra and PMI name both. Slurm names the rank
/// (`SLURM_LOCALID`) and the count as the job step's per-node list
/// (`SLURM_STEP_TASKS_PER_NODE`: `4(x2),3` is 4, 4 and 3) read at this node's place in the step
/// (`SLURM_NODEID`), else as `SLURM_NTASKS_PER_NODE` (which a step inherits from its
/// allocation's `--ntasks-per-node` even when it runs fewer), else as the allocation's list
/// (`SLURM_TASKS_PER_NODE`).
pub fn node_place(var: impl Fn(&str) -> Option<String>) -> (Option<usize>, Option<usize>) {
    let number = |k: &str| var(k)?.trim().parse::<usize>().ok();
    let slurm_list = |k: &str| {
        let counts = slurm_counts(&var(k)?)?;
        match number("SLURM_NODEID") {
            Some(node) => counts.get(node).copied(),
            // Without the node's place, a count every node shares.
            None => counts.first().copied().filter(|&c| counts.iter().all(|&x| x == c)),
        }
    };
    let local = ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"].into_iter().find_map(number);
    let on_node = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"]
        .into_iter()
        .find_map(number)
        .or_else(|| slurm_list("SLURM_STEP_TASKS_PER_NODE"))
        .or_else(|| number("SLURM_NTASKS_PER_NODE"))
        .or_else(|| slurm_list("SLURM_TASKS_PER_NODE"));
    (local, on_node)
}

/// Slurm's compressed per-node counts (`4(x2),3` -> 4, 4, 3); `None` where the list is not one.
fn slurm_counts(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let (count, times) = match entry.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (entry, 1),
        };
        let count = count.parse::<usize>().ok()?;
        out.extend(std::iter::repeat_n(count, times));
    }
    (!out.is_empty()).then_some(out)
}

/// The device of a GPU rank of a multi-process run that is rank `local` of `on_node` on its
/// node (see [`node_place`]), laid onto the node's `visible` devices by [`device_index`]
/// (`ranks_per_device` each when given, else spread evenly): with one rank per GPU, rank 5 of
/// two 4-GPU nodes takes GPU 1 of the second; 8 ranks of a one-GPU node all take GPU 0. Without
/// the node's rank count, `ranks_per_device` each when given, else the ranks dealt round the
/// visible devices (rank `l` on device `l % visible`), else rank `l` on device `l`. Other kinds
/// of device, and a process that does not know its place, keep `device`.
pub fn placed_on_node(
    device: RankDevice,
    (local, on_node): (Option<usize>, Option<usize>),
    visible: Option<usize>,
    ranks_per_device: Option<usize>,
) -> RankDevice {
    match (device, local) {
        (RankDevice::Cuda(_) | RankDevice::Rocm(_) | RankDevice::TchCuda(_), Some(l)) => {
            device.with_index(match (on_node, ranks_per_device, visible) {
                (Some(n), _, _) => device_index(l, n, visible, ranks_per_device),
                (None, Some(k), _) => l / k.max(1),
                (None, None, Some(v)) if v > 0 => l % v,
                (None, None, _) => l,
            })
        }
        (d, _) => d,
    }
}

/// The number of devices a `CUDA_VISIBLE_DEVICES`-style list names: its entries up to the first
/// empty or negative one (where the CUDA runtime stops reading it too).
pub fn count_visible(list: &str) -> usize {
    list.split(',').map(str::trim).take_while(|e| !e.is_empty() && !e.starts_with('-')).count()
}

impl RankDevice {
    /// Whether this build has the device's Burn backend (its feature is on).
    pub fn built(self) -> bool {
        match self {
            RankDevice::Flex => true,
            RankDevice::Wgpu => cfg!(feature = "wgpu"),
            RankDevice::Cuda(_) => cfg!(feature = "cuda"),
            RankDevice::Rocm(_) => cfg!(feature = "rocm"),
            RankDevice::TchCpu | RankDevice::TchCuda(_) => cfg!(feature = "tch"),
        }
    }

    /// The same kind of device with index `i` (Flex and wgpu have none).
    pub fn with_index(self, i: usize) -> Self {
        match self {
            RankDevice::Cuda(_) => RankDevice::Cuda(i),
            RankDevice::Rocm(_) => RankDevice::Rocm(i),
            RankDevice::TchCuda(_) => RankDevice::TchCuda(i),
            other => other,
        }
    }

    /// How many devices of this kind this process may use, where something says: the
    /// launcher's list (`CUDA_VISIBLE_DEVICES`; for ROCm `HIP_VISIBLE_DEVICES`,
    /// `ROCR_VISIBLE_DEVICES`, then `CUDA_VISIBLE_DEVICES`), else for CUDA the driver's count
    /// (LibTorch's, for LibTorch's CUDA devices). `None` for Flex, wgpu and LibTorch's CPU, and
    /// where nothing says.
    pub fn visible(self) -> Option<usize> {
        let vars: &[&str] = match self {
            RankDevice::Cuda(_) | RankDevice::TchCuda(_) => &["CUDA_VISIBLE_DEVICES"],
            RankDevice::Rocm(_) => &["HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"],
            _ => return None,
        };
        if let Some(list) = vars.iter().find_map(|v| std::env::var(v).ok()) {
            return Some(count_visible(&list));
        }
        match self {
            #[cfg(feature = "cuda")]
            RankDevice::Cuda(_) => cuda_driver_count(),
            #[cfg(feature = "tch")]
            RankDevice::TchCuda(_) => usize::try_from(tch::Cuda::device_count()).ok(),
            _ => None,
        }
    }

    /// The devices of `world` ranks in one process, spread over the visible devices of this
    /// kind by [`device_index`] (`ranks_per_device` ranks each when given). Flex, wgpu and
    /// LibTorch's CPU ranks all share their one device.
    pub fn for_ranks(self, world: usize, ranks_per_device: Option<usize>) -> Vec<RankDevice> {
        let visible = self.visible();
        (0..world).map(|r| self.with_index(device_index(r, world, visible, ranks_per_device))).collect()
    }

    /// [`RankDevice::device`], refused where it cannot compute in the arithmetic of `precision`.
    pub fn device_for(self, precision: Precision) -> Result<Device, DeviceError> {
        let device = self.device()?;
        if precision == Precision::Bf16Mixed && !device.supports_dtype(burn::tensor::FloatDType::BF16) {
            return Err(DeviceError(format!(
                "{self:?} has no bf16 arithmetic, so precision Bf16Mixed cannot run on it; use precision F32 there (Flex, CUDA and LibTorch compute in bf16)"
            )));
        }
        Ok(device)
    }

    /// The Burn device, or an error naming the feature this build lacks or the devices this
    /// process may see.
    pub fn device(self) -> Result<Device, DeviceError> {
        #[cfg(feature = "tch")]
        if matches!(self, RankDevice::TchCuda(_)) && !tch::Cuda::is_available() {
            return Err(DeviceError(format!(
                "{self:?}: LibTorch sees no CUDA device (no NVIDIA driver, or a libtorch built without CUDA)"
            )));
        }
        if let (RankDevice::Cuda(i) | RankDevice::Rocm(i) | RankDevice::TchCuda(i), Some(v)) = (self, self.visible())
            && i >= v
        {
            return Err(DeviceError(format!(
                "{self:?} is not among the {v} device(s) this process may use (CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES, or the driver); set `ranks_per_device` so that the ranks share them"
            )));
        }
        let missing = |feature: &str| DeviceError(format!("{self:?} needs copus-burn built with feature `{feature}`"));
        match self {
            RankDevice::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            RankDevice::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(not(feature = "wgpu"))]
            RankDevice::Wgpu => Err(missing("wgpu")),
            #[cfg(feature = "cuda")]
            RankDevice::Cuda(i) => Ok(Device::cuda(i)),
            #[cfg(not(feature = "cuda"))]
            RankDevice::Cuda(_) => Err(missing("cuda")),
            #[cfg(feature = "rocm")]
            RankDevice::Rocm(i) => Ok(Device::rocm(i)),
            #[cfg(not(feature = "rocm"))]
            RankDevice::Rocm(_) => Err(missing("rocm")),
            // Burn marks its LibTorch backend deprecated; it is the backend that links against
            // a PyTorch installation's CUDA libraries without building LLVM.
            #[cfg(feature = "tch")]
            #[allow(deprecated)]
            RankDevice::TchCpu => Ok(Device::libtorch()),
            #[cfg(feature = "tch")]
            #[allow(deprecated)]
            RankDevice::TchCuda(i) => Ok(Device::libtorch_cuda(i)),
            #[cfg(not(feature = "tch"))]
            RankDevice::TchCpu | RankDevice::TchCuda(_) => Err(missing("tch")),
        }
    }
}

/// The CUDA driver's device count (which already honours `CUDA_VISIBLE_DEVICES`); `None` where
/// no driver is installed.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn cuda_driver_count() -> Option<usize> {
    // SAFETY: the call only tries to `dlopen` the driver library's candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    cudarc::driver::CudaContext::device_count().ok().and_then(|n| usize::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indices(on_node: usize, visible: Option<usize>, per: Option<usize>) -> Vec<usize> {
        (0..on_node).map(|l| device_index(l, on_node, visible, per)).collect()
    }

    /// Ranks spread evenly over the visible devices, `ranks_per_device` each when given, one per
    /// device when nothing says how many there are.
    #[test]
    fn ranks_share_the_visible_devices() {
        assert_eq!(indices(8, Some(1), None), vec![0; 8], "8 ranks on one GPU");
        assert_eq!(indices(8, Some(8), None), (0..8).collect::<Vec<_>>(), "one rank per GPU");
        assert_eq!(indices(8, Some(3), None), vec![0, 0, 0, 1, 1, 1, 2, 2]);
        assert_eq!(indices(4, Some(8), None), vec![0, 1, 2, 3], "more GPUs than ranks");
        assert_eq!(indices(8, Some(8), Some(4)), vec![0, 0, 0, 0, 1, 1, 1, 1], "ranks_per_device wins");
        assert_eq!(indices(3, None, None), vec![0, 1, 2], "nothing known: rank r on device r");
        assert_eq!(indices(6, None, Some(2)), vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(indices(2, Some(0), None), vec![0, 1], "an empty list is the device's error, not a division by zero");
    }

    /// A device list counts its entries up to the first empty or negative one, as CUDA reads it.
    #[test]
    fn visible_device_lists_count_like_the_cuda_runtime() {
        assert_eq!(count_visible("0,1,2,3"), 4);
        assert_eq!(count_visible("3"), 1);
        assert_eq!(count_visible(""), 0);
        assert_eq!(count_visible("-1"), 0);
        assert_eq!(count_visible("2,-1,3"), 1);
        assert_eq!(count_visible("GPU-8f3a, GPU-11c0"), 2);
    }

    /// The node's place from each launcher's variables; Slurm's per-node lists read at this
    /// node's place.
    #[test]
    fn launchers_tell_a_process_its_place_on_the_node() {
        let env = |pairs: &[(&str, &str)]| {
            let map: std::collections::HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            node_place(move |k| map.get(k).cloned())
        };
        assert_eq!(env(&[]), (None, None));
        assert_eq!(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "3"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "8")]), (Some(3), Some(8)));
        assert_eq!(env(&[("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")]), (Some(1), Some(2)));
        assert_eq!(env(&[("PMI_LOCAL_RANK", "0"), ("PMI_LOCAL_SIZE", "4")]), (Some(0), Some(4)));
        assert_eq!(env(&[("SLURM_LOCALID", "2"), ("SLURM_NTASKS_PER_NODE", "4")]), (Some(2), Some(4)));
        // srun without --ntasks-per-node: the per-node list, at this node's place.
        let slurm = [("SLURM_LOCALID", "1"), ("SLURM_STEP_TASKS_PER_NODE", "4(x2),3"), ("SLURM_NODEID", "2")];
        assert_eq!(env(&slurm), (Some(1), Some(3)));
        // A step of 4 in an allocation of 8 per node: the step's list, not the inherited count.
        let step =
            [("SLURM_LOCALID", "1"), ("SLURM_NTASKS_PER_NODE", "8"), ("SLURM_STEP_TASKS_PER_NODE", "4"), ("SLURM_TASKS_PER_NODE", "8")];
        assert_eq!(env(&step), (Some(1), Some(4)));
        assert_eq!(env(&[("SLURM_LOCALID", "1"), ("SLURM_NTASKS_PER_NODE", "8"), ("SLURM_TASKS_PER_NODE", "2")]), (Some(1), Some(8)));
        assert_eq!(env(&[("SLURM_LOCALID", "5"), ("SLURM_TASKS_PER_NODE", "8(x2)")]), (Some(5), Some(8)), "every node alike");
        assert_eq!(env(&[("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "4,3")]), (Some(1), None), "nodes differ, place unknown");
        assert_eq!(env(&[("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "4(x")]), (Some(1), None), "not a list");
        assert_eq!(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "x")]), (None, None));
        // Open MPI inside a Slurm allocation: the launcher that started the process speaks first.
        assert_eq!(
            env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "0"), ("SLURM_LOCALID", "7"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")]),
            (Some(0), Some(2))
        );
    }

    /// A node's place onto its devices: 8 ranks on one GPU share it, one per GPU on 8; without
    /// the node's count, dealt round the visible devices (or `ranks_per_device` each, or rank
    /// `l` on device `l` when nothing is known); CPU kinds keep their device.
    #[test]
    fn ranks_of_a_node_take_its_devices() {
        let cuda = RankDevice::Cuda(0);
        let place = |local, on_node, visible, per| placed_on_node(cuda, (local, on_node), visible, per);
        assert_eq!((0..8).map(|l| place(Some(l), Some(8), Some(1), None)).collect::<Vec<_>>(), vec![cuda; 8]);
        assert_eq!(place(Some(5), Some(8), Some(8), None), RankDevice::Cuda(5));
        assert_eq!(place(Some(5), Some(8), Some(4), None), RankDevice::Cuda(2));
        // The node's count unknown: dealt round the visible devices, or ranks_per_device each.
        assert_eq!(place(Some(5), None, Some(1), None), cuda, "one GPU: all on it");
        assert_eq!(place(Some(5), None, Some(4), None), RankDevice::Cuda(1));
        assert_eq!(place(Some(5), None, Some(4), Some(2)), RankDevice::Cuda(2));
        assert_eq!(place(Some(5), None, None, None), RankDevice::Cuda(5), "nothing known: rank l on device l");
        assert_eq!(place(Some(5), Some(8), Some(1), Some(8)), cuda, "ranks_per_device");
        assert_eq!(place(None, Some(8), Some(1), None), cuda, "the place unknown");
        assert_eq!(placed_on_node(RankDevice::TchCuda(3), (Some(1), Some(2)), Some(2), None), RankDevice::TchCuda(1));
        assert_eq!(placed_on_node(RankDevice::Rocm(0), (Some(3), Some(4)), Some(2), None), RankDevice::Rocm(1));
        assert_eq!(placed_on_node(RankDevice::Wgpu, (Some(3), Some(4)), None, None), RankDevice::Wgpu);
        assert_eq!(placed_on_node(RankDevice::TchCpu, (Some(3), Some(4)), None, None), RankDevice::TchCpu);
    }

    /// One process's ranks: GPU kinds spread, the others share their one device.
    #[test]
    fn ranks_of_one_process_get_their_devices() {
        assert_eq!(RankDevice::Wgpu.for_ranks(3, None), vec![RankDevice::Wgpu; 3]);
        assert_eq!(RankDevice::Flex.for_ranks(2, Some(2)), vec![RankDevice::Flex; 2]);
        let cuda = RankDevice::Cuda(0).for_ranks(4, Some(2));
        assert_eq!(cuda, vec![RankDevice::Cuda(0), RankDevice::Cuda(0), RankDevice::Cuda(1), RankDevice::Cuda(1)]);
        assert_eq!(RankDevice::Rocm(7).with_index(1), RankDevice::Rocm(1));
        assert!(RankDevice::Flex.built());
    }
}
