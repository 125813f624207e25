//! ZeRO stage 1: the AdamW state sharded over the data-parallel replicas.
//!
//! A stage's parameters, flattened in visit order into one buffer of N elements and padded to
//! `dp * ceil(N / dp)`, split into `dp` equal contiguous chunks; dp rank `d` owns chunk `d`.
//! A chunk may start or end inside a parameter, so a rank keeps, for each parameter its chunk
//! overlaps, the moments of that piece only (flat, of the piece's length). One step:
//! - the accumulated gradient is reduce-scattered over dp (summed in rank order, as the
//!   unsharded all-reduce of in-process ranks sums it): each rank holds the reduced gradient of
//!   its chunk only. A group that cannot reduce-scatter without gathering whole buffers (MPI,
//!   and the GPU libraries on host buffers) all-reduces the gradient in buckets, as the
//!   unsharded step does, and each rank keeps its chunk;
//! - the squared norm of the reduced gradient is summed over the chunk's counted elements and
//!   then over the world (the dp chunks and the model-parallel shards are disjoint), so the
//!   probe and clipping see the number the unsharded step computes, to rounding;
//! - each rank runs AdamW on its pieces (the same arithmetic, element for element) and the
//!   updated pieces are all-gathered over dp into every replica's weights.
//!
//! With dp > 1 a step has at least two micro-batches, so the probe never keeps a previous
//! gradient here. Checkpoints and exports take each replica's pieces without a collective
//! ([`ZeroPlan::pieces_for_export`]; `TrainingState::from_exports` stitches them); a live
//! layout change all-gathers the moments over dp into whole tensors, moved and checked as
//! unsharded ones are; a rank built from whole moments keeps its pieces ([`ZeroPlan::shard`]).
//! Where every rank is on a device and the group combines tensors where they lie (in-process
//! ranks, and NCCL on LibTorch's CUDA tensors), the chunk, the update, the gathered weights and
//! a layout change's gathered and re-cut moments stay on the devices; otherwise (Flex, MPI, RCCL,
//! NCCL on CubeCL's tensors) the collectives go through host buffers.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use super::grad_index::GradIndex;
use crate::comm::{Collective, CommError, ReduceOp};
use crate::grads::{read_sum, with_values};
use crate::optim::{self as adamw, AdamW, Moments, marked_as};
use crate::state::OptimScalars;
use crate::traffic::{self, Kind};

/// (global name, field, values) of optimizer state pieces.
type Pieces = Vec<(String, String, Vec<f32>)>;

/// One parameter of the stage in the flat buffer.
#[derive(Clone, Debug)]
struct Slot {
    id: ParamId,
    /// Module path within the stage (what weight decay's groups match).
    path: String,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
    /// Counted in a whole-model norm (see `ParamInfo::counted`).
    counted: bool,
}

/// How one rank's stage is sharded over its dp group.
#[derive(Clone, Debug)]
pub(super) struct ZeroPlan {
    dp: usize,
    dp_rank: usize,
    slots: Vec<Slot>,
    /// Elements per dp rank.
    chunk: usize,
}

/// A parameter's part of this rank's chunk: the slot, the range within the parameter (flat),
/// the range within the chunk.
type Piece<'a> = (&'a Slot, Range<usize>, Range<usize>);

impl ZeroPlan {
    /// The plan of `stage` (parameters as `index` describes them) for dp rank `dp_rank` of `dp`,
    /// on tp rank `tp_rank`.
    pub(super) fn new<S: Module>(stage: &S, index: &GradIndex, tp_rank: usize, dp: usize, dp_rank: usize) -> Self {
        let mut offset = 0;
        let mut slots = Vec::new();
        for ((path, id, shape), info) in crate::parallel::param_paths(stage).into_iter().zip(&index.params) {
            debug_assert_eq!(id, info.id, "the index lists the stage's parameters in visit order");
            let len = shape.iter().product();
            slots.push(Slot { id, path, shape, offset, len, counted: info.counted(tp_rank) });
            offset += len;
        }
        Self { dp, dp_rank, slots, chunk: offset.div_ceil(dp.max(1)) }
    }

    /// Elements of the padded flat buffer.
    fn padded(&self) -> usize {
        self.chunk * self.dp
    }

    /// Parameters' parts of dp rank `d`'s chunk, in order.
    fn pieces_of(&self, d: usize) -> impl Iterator<Item = Piece<'_>> {
        let (start, end) = (d * self.chunk, (d + 1) * self.chunk);
        self.slots.iter().filter_map(move |s| {
            let (a, b) = (s.offset.max(start), (s.offset + s.len).min(end));
            (a < b).then(|| (s, a - s.offset..b - s.offset, a - start..b - start))
        })
    }

    /// This rank's pieces.
    fn pieces(&self) -> impl Iterator<Item = Piece<'_>> {
        self.pieces_of(self.dp_rank)
    }

    /// Replaces whole moments in `optim` with this rank's pieces of them (copied, so the
    /// whole tensors are freed); moments of parameters outside the chunk are dropped. With
    /// `on_device`, each piece is cut and copied where the moments lie; otherwise through host
    /// memory, onto `device`.
    pub(super) fn shard(&self, optim: &mut AdamW, device: &Device, on_device: bool) -> Result<(), String> {
        let mine: HashMap<ParamId, Vec<(Range<usize>, usize)>> = self.pieces().fold(HashMap::new(), |mut m, (s, p, _)| {
            m.entry(s.id).or_default().push((p, s.len));
            m
        });
        for s in &self.slots {
            let Some(m) = optim.take_moments(s.id) else { continue };
            let Some(parts) = mine.get(&s.id) else { continue };
            let [(range, len)] = parts.as_slice() else { unreachable!("a chunk holds one contiguous piece of a parameter") };
            if m.m1.shape().num_elements() != *len || m.m2.shape().num_elements() != *len {
                return Err(format!("`{}` has moments of {} elements for a parameter of {len}", s.path, m.m1.shape().num_elements()));
            }
            let piece = if on_device {
                // `cat` copies the slice's bits into a buffer of its own (arithmetic might flush
                // a subnormal second moment), so the whole moment is freed.
                let cut = |t: &Tensor<1>| Tensor::cat(vec![t.clone().slice(range.clone())], 0);
                Moments::from_tensors(m.time, vec![range.len()], cut(&m.m1), cut(&m.m2))?
            } else {
                let cut = |t: &Tensor<1>| with_values(t, Kind::State, |v| v[range.clone()].to_vec());
                Moments::from_values(m.time, vec![range.len()], cut(&m.m1), cut(&m.m2), device)?
            };
            optim.set_moments(s.id, piece);
        }
        Ok(())
    }

    /// The whole moments of every parameter, all-gathered over `dp` from each rank's pieces (a
    /// collective: every rank of the dp group calls it). Empty when no rank has stepped. With
    /// `on_device` the pieces are joined and gathered where they lie (`dp` gathers tensors in
    /// place); otherwise through host memory, onto `device`.
    pub(super) fn gather<C: Collective>(
        &self,
        optim: &AdamW,
        dp: &C,
        device: &Device,
        on_device: bool,
    ) -> Result<Vec<(ParamId, Moments)>, CommError> {
        let mut stepped = [f64::from(u8::from(!optim.is_empty()))];
        dp.all_reduce(&mut stepped, ReduceOp::Max)?;
        if stepped[0] == 0.0 {
            return Ok(Vec::new());
        }
        // Each parameter's step count, from the ranks holding a piece of it.
        let mut times: Vec<f64> = self.slots.iter().map(|s| optim.moments(s.id).map_or(0.0, |m| m.time as f64)).collect();
        dp.all_reduce(&mut times, ReduceOp::Max)?;
        if on_device {
            return self.gather_on_device(optim, dp, device, &times);
        }
        let (mut m1, mut m2) = (vec![0f32; self.chunk], vec![0f32; self.chunk]);
        for (s, _, at) in self.pieces() {
            if let Some(m) = optim.moments(s.id) {
                with_values(&m.m1, Kind::State, |v| m1[at.clone()].copy_from_slice(v));
                with_values(&m.m2, Kind::State, |v| m2[at].copy_from_slice(v));
            }
        }
        let (m1, m2) = (dp.all_gather(&m1)?, dp.all_gather(&m2)?);
        let mut out = Vec::with_capacity(self.slots.len());
        for (s, &time) in self.slots.iter().zip(&times) {
            let r = s.offset..s.offset + s.len;
            let m = Moments::from_values(time as usize, s.shape.clone(), m1[r.clone()].to_vec(), m2[r].to_vec(), device)
                .map_err(CommError::Invalid)?;
            out.push((s.id, m));
        }
        Ok(out)
    }

    /// [`Self::gather`] on the device: this rank's chunk of each moment joined from its pieces
    /// (zeros where it has none), all-gathered as a tensor, and each parameter's moments sliced
    /// from the whole.
    fn gather_on_device<C: Collective>(
        &self,
        optim: &AdamW,
        dp: &C,
        device: &Device,
        times: &[f64],
    ) -> Result<Vec<(ParamId, Moments)>, CommError> {
        let chunk = |which: fn(&Moments) -> &Tensor<1>| -> Result<Tensor<1>, CommError> {
            let mut parts = Vec::new();
            let mut at = 0;
            for (s, _, range) in self.pieces() {
                if range.start > at {
                    parts.push(Tensor::zeros([range.start - at], device));
                }
                parts.push(match optim.moments(s.id) {
                    Some(m) if which(m).dims()[0] == range.len() => which(m).clone(),
                    Some(m) => {
                        return Err(CommError::Invalid(format!(
                            "`{}` has a moment piece of {} elements for {} of the chunk",
                            s.path,
                            which(m).dims()[0],
                            range.len()
                        )));
                    }
                    None => Tensor::zeros([range.len()], device),
                });
                at = range.end;
            }
            if at < self.chunk {
                parts.push(Tensor::zeros([self.chunk - at], device));
            }
            dp.all_gather_tensor(Tensor::cat(parts, 0))
        };
        let (m1, m2) = (chunk(|m| &m.m1)?, chunk(|m| &m.m2)?);
        let mut out = Vec::with_capacity(self.slots.len());
        for (s, &time) in self.slots.iter().zip(times) {
            let r = s.offset..s.offset + s.len;
            let m = Moments::from_tensors(time as usize, s.shape.clone(), m1.clone().slice(r.clone()), m2.clone().slice(r))
                .map_err(CommError::Invalid)?;
            out.push((s.id, m));
        }
        Ok(out)
    }

    /// This rank's pieces of the moments for staging, without a collective: (global name,
    /// field, values), where each piece starts in its parameter (flat), and the scalars of the
    /// parameters it holds pieces of (their rank: the parameter's, not the piece's).
    pub(super) fn pieces_for_export(&self, optim: &AdamW, names: &HashMap<ParamId, String>) -> (Pieces, Vec<usize>, OptimScalars) {
        let (mut pieces, mut offsets, mut scalars) = (Vec::new(), Vec::new(), Vec::new());
        for (s, range, _) in self.pieces() {
            let (Some(m), Some(name)) = (optim.moments(s.id), names.get(&s.id)) else { continue };
            for (field, t) in [(adamw::MOMENT_1, &m.m1), (adamw::MOMENT_2, &m.m2)] {
                pieces.push((name.clone(), field.to_string(), with_values(t, Kind::State, <[f32]>::to_vec)));
                offsets.push(range.start);
            }
            let whole = Moments { shape: s.shape.clone(), ..m.clone() };
            scalars.extend(whole.scalars().into_iter().map(|(f, v)| (name.clone(), f.to_string(), v)));
        }
        (pieces, offsets, scalars)
    }

    /// The accumulated gradient `acc` reduce-scattered over `dp`: this rank's chunk of the sum.
    /// `on_device`: as one tensor where the gradients lie (the ranks' devices, an in-process
    /// group), else through a host buffer. Each gradient is freed once copied into the flat
    /// buffer, which is handed to the collective, so the step holds one copy of the gradient at
    /// a time.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce<S: Module, C: Collective>(
        &self,
        stage: &S,
        index: &GradIndex,
        mut acc: GradientsParams,
        dp: &C,
        on_device: bool,
        bucket: usize,
    ) -> Result<Chunk, CommError> {
        if on_device && let Some(flat) = index.flatten_on_device(stage, &acc, |_| true) {
            drop(acc);
            let pad = self.padded() - flat.dims()[0];
            let flat = if pad > 0 {
                let device = flat.device();
                Tensor::cat(vec![flat, Tensor::zeros([pad], &device)], 0)
            } else {
                flat
            };
            return Ok(Chunk::Device(dp.reduce_scatter_tensor(flat, ReduceOp::Sum)?));
        }
        let mut flat = index.flatten_taking(stage, &mut acc, |_| true);
        flat.resize(self.padded(), 0.0);
        if dp.reduces_tensors_in_place() {
            return Ok(Chunk::Host(dp.reduce_scatter_owned(flat, ReduceOp::Sum)?));
        }
        // MPI's and the GPU libraries' host reduce-scatter here gathers every rank's whole
        // buffer: all-reduce in buckets instead, and keep this rank's chunk.
        for part in flat.chunks_mut(bucket.max(1)) {
            dp.all_reduce(part, ReduceOp::Sum)?;
        }
        let mine = self.dp_rank * self.chunk..(self.dp_rank + 1) * self.chunk;
        flat.truncate(mine.end);
        Ok(Chunk::Host(flat.split_off(mine.start)))
    }

    /// Sum of squares of the counted elements of a reduced `chunk`, in f64 (on a device, each
    /// piece's sum reduced there in f32 and the sums read back together).
    pub(super) fn sq_norm(&self, chunk: &Chunk) -> f64 {
        let counted = self.pieces().filter(|(s, _, _)| s.counted);
        match chunk {
            Chunk::Host(v) => counted.map(|(_, _, at)| v[at].iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>()).sum(),
            Chunk::Device(t) => read_sum(counted.map(|(_, _, at)| t.clone().narrow(0, at.start, at.len()).square().sum()).collect()),
        }
    }

    /// AdamW at learning rate `lr` on this rank's pieces of `stage`'s parameters, with the
    /// reduced gradient `chunk` scaled by `factor` (clipping), then the updated pieces
    /// all-gathered over `dp` into the weights (as tensors where the chunk is one): the stage
    /// after the update.
    pub(super) fn update<S: Module, C: Collective>(
        &self,
        optim: &mut AdamW,
        stage: S,
        chunk: Chunk,
        factor: f64,
        lr: f64,
        dp: &C,
    ) -> Result<S, CommError> {
        let weights: HashMap<ParamId, Tensor<1>> = crate::parallel::flat_params(&stage).into_iter().map(|(_, id, _, t)| (id, t)).collect();
        let mut updated = Vec::new();
        for (s, range, at) in self.pieces() {
            let p = weights[&s.id].clone().narrow(0, range.start, range.len());
            // On the host the piece gets a buffer of its own (a view would make the update copy
            // its whole parameter before writing the piece).
            let p = match &chunk {
                Chunk::Host(_) => {
                    let values = with_values(&p, Kind::State, <[f32]>::to_vec);
                    traffic::upload::<1, _>(TensorData::new(values, [range.len()]), &p.device(), Kind::State)
                }
                Chunk::Device(_) => p,
            };
            let g = match &chunk {
                Chunk::Host(v) => {
                    let g: Vec<f32> =
                        if factor == 1.0 { v[at.clone()].to_vec() } else { v[at.clone()].iter().map(|&g| g * factor as f32).collect() };
                    traffic::upload::<1, _>(TensorData::new(g, [range.len()]), &p.device(), Kind::Collective)
                }
                Chunk::Device(t) => {
                    let g = t.clone().narrow(0, at.start, at.len());
                    if factor == 1.0 { g } else { g.mul_scalar(factor) }
                }
            };
            updated.push((at, optim.update_piece(s.id, &s.path, p, g, lr)));
        }
        drop(weights);
        let offsets = self.slots.iter().map(|s| (s.id, s.offset)).collect();
        let all = match chunk {
            Chunk::Host(_) => {
                let mut mine = vec![0f32; self.chunk];
                for (at, t) in &updated {
                    with_values(t, Kind::Collective, |v| mine[at.clone()].copy_from_slice(v));
                }
                drop(updated);
                Flat::Host(dp.all_gather(&mine)?)
            }
            Chunk::Device(t) => {
                let device = t.device();
                drop(t);
                let filled: usize = updated.iter().map(|(at, _)| at.len()).sum();
                let mut parts: Vec<Tensor<1>> = updated.into_iter().map(|(_, t)| t).collect();
                if filled < self.chunk {
                    // The padding (the last rank's chunk ends past the parameters).
                    parts.push(Tensor::zeros([self.chunk - filled], &device));
                }
                Flat::Device(dp.all_gather_tensor(Tensor::cat(parts, 0))?)
            }
        };
        Ok(stage.map(&mut SetWeights { flat: all, offsets }))
    }
}

/// A rank's chunk of the reduced gradient: a host buffer, or a tensor on the rank's device.
// One per step, moved rather than copied; boxing the tensor would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Chunk {
    Host(Vec<f32>),
    Device(Tensor<1>),
}

/// The updated weights of the whole stage, flat.
#[allow(clippy::large_enum_variant)]
enum Flat {
    Host(Vec<f32>),
    Device(Tensor<1>),
}

/// Sets every parameter listed to its values in the flat weights.
struct SetWeights {
    flat: Flat,
    offsets: HashMap<ParamId, usize>,
}

impl ModuleMapper for SetWeights {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(&at) = self.offsets.get(&id) else { return Param::from_mapped_value(id, tensor, mapper) };
        let mark = marked_as(id, &tensor);
        let inner = tensor.inner();
        let shape = inner.shape();
        let n = shape.num_elements();
        let updated = match &self.flat {
            Flat::Host(v) => traffic::upload::<D, _>(TensorData::new(v[at..at + n].to_vec(), shape), &inner.device(), Kind::Collective),
            Flat::Device(t) => t.clone().narrow(0, at, n).reshape(shape),
        };
        Param::from_mapped_value(id, mark(updated), mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::threads::ThreadComm;
    use crate::engine::grad_index::{ParamInfo, Role};
    use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};

    #[derive(Module, Debug)]
    struct Net {
        emb: Embedding,
        lin: Linear,
    }

    fn net() -> Net {
        let device = Device::flex().autodiff();
        Net { emb: EmbeddingConfig::new(7, 5).init(&device), lin: LinearConfig::new(5, 3).init(&device) }
    }

    fn plan(net: &Net, dp: usize, d: usize) -> ZeroPlan {
        let params = crate::parallel::param_paths(net)
            .into_iter()
            .map(|(_, id, _)| ParamInfo { id, role: Role::Sharded, mirror: false, tied_owner: false })
            .collect();
        ZeroPlan::new(net, &GradIndex::new(params, Device::flex()), 0, dp, d)
    }

    /// Every parameter's whole moments, with values that tell the elements apart.
    fn whole(net: &Net) -> AdamW {
        let mut optim = AdamW::new(0.9, 0.95, 1e-8, 0.0, &[]);
        for (k, (_, id, shape)) in crate::parallel::param_paths(net).into_iter().enumerate() {
            let n: usize = shape.iter().product();
            let m1 = (0..n).map(|i| (100 * k + i) as f32).collect();
            let m2 = (0..n).map(|i| -((100 * k + i) as f32)).collect();
            optim.set_moments(id, Moments::from_values(3 + k, shape, m1, m2, &Device::flex()).unwrap());
        }
        optim
    }

    /// 35 + 15 + 3 = 53 elements over 3 ranks (chunks of 18, the last padded by one): the
    /// chunks cover every element once; each rank keeps only its pieces; gathering them back
    /// gives every whole moment and step count exactly.
    #[test]
    fn the_shards_cover_the_moments_once_and_gather_back_whole() {
        let net = net();
        let dp = 3;
        let mut covered = vec![0; 53];
        for d in 0..dp {
            for (s, range, at) in plan(&net, dp, d).pieces() {
                assert_eq!(range.len(), at.len());
                assert!(at.end <= 18, "rank {d}: {at:?}");
                covered[s.offset + range.start..s.offset + range.end].iter_mut().for_each(|c| *c += 1);
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "{covered:?}");
        let want = whole(&net);
        let ids: Vec<ParamId> = crate::parallel::param_paths(&net).into_iter().map(|(_, id, _)| id).collect();
        let comms = ThreadComm::world(dp);
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(d, comm)| {
                let (net, mut optim) = (net.clone(), whole(&net));
                std::thread::spawn(move || {
                    let p = plan(&net, dp, d);
                    p.shard(&mut optim, &Device::flex(), false).unwrap();
                    let kept: usize = optim.ids().map(|id| optim.moments(id).unwrap().m1.shape().num_elements()).sum();
                    let gathered = p.gather(&optim, &comm, &Device::flex(), false).unwrap();
                    (kept, gathered)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(results.iter().map(|r| r.0).collect::<Vec<_>>(), vec![18, 18, 17], "each rank keeps its chunk");
        let values = |t: &Tensor<1>| t.clone().into_data().try_to_vec::<f32>().unwrap();
        for (_, gathered) in results {
            assert_eq!(gathered.len(), ids.len());
            for (id, m) in gathered {
                let w = want.moments(id).unwrap();
                assert_eq!((m.time, &m.shape), (w.time, &w.shape));
                assert_eq!((values(&m.m1), values(&m.m2)), (values(&w.m1), values(&w.m2)));
            }
        }
    }
}
