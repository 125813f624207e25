//! Named f32 tensors and a JSON header in one burnpack buffer: the checkpoint format, and what
//! the processes of a multi-process run send each other (training states, rank exports,
//! parameters).

use burn::tensor::TensorData;

/// `(name, shape, values)` of one tensor.
pub(crate) type Named = (String, Vec<usize>, Vec<f32>);

/// Writes `tensors` and the header `meta` (stored under `key`) as burnpack bytes.
pub(crate) fn pack(key: &str, meta: &str, tensors: impl IntoIterator<Item = Named>) -> Result<Vec<u8>, String> {
    let tensors: Vec<burn_pack::Tensor> = tensors
        .into_iter()
        .map(|(name, shape, values)| {
            let (bytes, shape, dtype) = TensorData::new(values, shape).into_parts();
            burn_pack::Tensor::new(name, dtype, shape, None, bytes)
        })
        .collect();
    let bytes = burn_pack::Writer::new(tensors)
        .with_metadata(key, meta)
        .with_metadata(&format!("{key}.hash"), &format!("{:016x}", byte_hash(meta.as_bytes())))
        .into_bytes()
        .map_err(|e| format!("{e:?}"))?;
    Ok(bytes.to_vec())
}

/// A 64-bit FNV-1a hash of bytes (guards headers against corruption).
pub(crate) fn byte_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Reads what [`pack`] wrote: the header under `key` (checked against its hash when one is
/// stored) and the tensors.
#[cfg(any(feature = "mpi", test))]
pub(crate) fn unpack(key: &str, bytes: Vec<u8>) -> Result<(String, Vec<Named>), String> {
    unpack_hashed(key, bytes).map(|(m, t, _)| (m, t))
}

/// [`unpack`], also telling whether the header carried a hash (files of every current format
/// do; older ones did not).
pub(crate) fn unpack_hashed(key: &str, bytes: Vec<u8>) -> Result<(String, Vec<Named>, bool), String> {
    let reader = burn_pack::Reader::from_bytes(burn_pack::Bytes::from_bytes_vec(bytes)).map_err(|e| format!("not readable: {e:?}"))?;
    let meta = reader.metadata().get(key).cloned().ok_or_else(|| format!("no `{key}` header"))?;
    let stored_hash = reader.metadata().get(&format!("{key}.hash")).cloned();
    if let Some(stored) = &stored_hash {
        let computed = format!("{:016x}", byte_hash(meta.as_bytes()));
        if stored != &computed {
            return Err(format!("the `{key}` header is corrupt (hash {computed}, stored {stored})"));
        }
    }
    let mut out = Vec::new();
    for t in reader.into_tensors().map_err(|e| format!("{e:?}"))? {
        let (name, dtype, shape, _, bytes) = t.into_parts().map_err(|e| format!("{e:?}"))?;
        // The element type and the byte length are checked against the shape before anything is
        // decoded, so a crafted tensor is an error here, not a panic in decoding.
        if dtype != burn::tensor::DType::F32 {
            return Err(format!("tensor `{name}` is {dtype:?}; copus stores f32"));
        }
        let shape: Vec<usize> = shape.iter().copied().collect();
        let bytes: &[u8] = &bytes;
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if elements.and_then(|n| n.checked_mul(4)) != Some(bytes.len()) {
            return Err(format!("tensor `{name}` of shape {shape:?} holds {} bytes, not 4 per element", bytes.len()));
        }
        let values = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        out.push((name, shape, values));
    }
    Ok((meta, out, stored_hash.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_and_header_round_trip_bit_for_bit() {
        let tensors = vec![
            ("a".to_string(), vec![2, 3], vec![1.0, -0.0, f32::MIN_POSITIVE, 3.5, f32::MAX, 1e-30]),
            ("b/c".to_string(), vec![1], vec![f32::NAN]),
            ("empty".to_string(), vec![0], vec![]),
        ];
        let bytes = pack("k", r#"{"x":1}"#, tensors.clone()).unwrap();
        let (meta, back) = unpack("k", bytes.clone()).unwrap();
        assert_eq!(meta, r#"{"x":1}"#);
        let mut back = back;
        back.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(back.len(), 3);
        for (want, got) in tensors.iter().zip(&back) {
            assert_eq!((&want.0, &want.1), (&got.0, &got.1));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&want.2), bits(&got.2));
        }
        assert!(unpack("other", bytes).unwrap_err().contains("no `other` header"));
        assert!(unpack("k", vec![1, 2, 3]).is_err());
    }

    /// A file whose header hash is right but whose tensor is not f32 is an error naming the
    /// tensor (a byte length that does not match the shape is refused too; burnpack's own
    /// writer cannot produce one to test it with).
    #[test]
    fn a_crafted_tensor_is_an_error_before_it_is_decoded() {
        let craft = |dtype: burn::tensor::DType, shape: Vec<usize>, bytes: Vec<u8>| {
            let t = burn_pack::Tensor::new("w".into(), dtype, shape, None, burn::tensor::Bytes::from_bytes_vec(bytes));
            let meta = "{}";
            burn_pack::Writer::new(vec![t])
                .with_metadata("k", meta)
                .with_metadata("k.hash", &format!("{:016x}", byte_hash(meta.as_bytes())))
                .into_bytes()
                .unwrap()
                .to_vec()
        };
        let e = unpack("k", craft(burn::tensor::DType::F64, vec![2], vec![0; 16])).unwrap_err();
        assert!(e.contains("`w`") && e.contains("F64"), "{e}");
    }
}
