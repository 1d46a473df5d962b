//! The block codec: one safetensors file per block, kvstore metadata in the header, and a
//! blake3 checksum over metadata and plane bytes verified on every decode.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use bytes::Bytes;
use safetensors::tensor::TensorView;

use crate::block::{check_lengths, Block, BlockMeta, Dtype, LayoutError, Plane, PlaneSpec};
use crate::format;
use crate::fs::ReadAt;
use crate::key::{block_key, BlockKey, NamespaceId};

/// Why bytes are not a valid block. Every variant means "treat as a miss".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The file is shorter than its header says.
    #[error("truncated: {found} bytes, the header needs {needed}")]
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        found: u64,
    },
    /// The safetensors header does not parse.
    #[error("not a valid safetensors file: {0}")]
    Safetensors(String),
    /// A safetensors file without kvstore metadata, or with another format name.
    #[error("not a kvstore block (format {found:?})")]
    Foreign {
        /// The `kvstore.format` value found, if any.
        found: Option<String>,
    },
    /// A kvstore block of a format version this build does not read.
    #[error(
        "block format version {found}, this build reads version {}",
        format::FORMAT_VERSION
    )]
    UnsupportedVersion {
        /// Version found.
        found: String,
    },
    /// A metadata key is missing.
    #[error("metadata key {0} is missing")]
    MissingField(&'static str),
    /// A metadata value does not parse.
    #[error("metadata key {field} has invalid value {value:?}")]
    BadField {
        /// Metadata key.
        field: &'static str,
        /// Value found (cut to 80 characters).
        value: String,
    },
    /// A tensor has a dtype the store does not carry.
    #[error("plane {plane:?} has unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// Plane name.
        plane: String,
        /// Dtype found.
        dtype: String,
    },
    /// The planes listed in the metadata and the tensors in the file differ.
    #[error("plane list and tensors differ: {0}")]
    Planes(String),
    /// Plane bytes do not match dtype and shape.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The stored checksum does not match the bytes.
    #[error("checksum mismatch: stored {stored}, computed {computed}")]
    Checksum {
        /// Stored checksum, hex.
        stored: String,
        /// Computed checksum, hex.
        computed: String,
    },
    /// The stored key is not `blake3(parent || tokens)`.
    #[error("key {stored} does not match parent and tokens (computed {computed})")]
    Key {
        /// Stored key.
        stored: BlockKey,
        /// Key computed from parent and tokens.
        computed: BlockKey,
    },
}

/// A block file's header: metadata and plane layout, read without the data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    /// Block metadata.
    pub meta: BlockMeta,
    /// Plane layout in block order.
    pub planes: Vec<PlaneSpec>,
    /// Stored checksum.
    pub checksum: [u8; 32],
    /// Bytes of plane data.
    pub data_len: u64,
    /// Total file length in bytes.
    pub file_len: u64,
}

fn bad(field: &'static str, value: &str) -> DecodeError {
    DecodeError::BadField {
        field,
        value: value.chars().take(80).collect(),
    }
}

fn hex(bytes: &[u8; 32]) -> String {
    BlockKey(*bytes).to_string()
}

fn put_lp(h: &mut blake3::Hasher, b: &[u8]) {
    h.update(&(b.len() as u64).to_le_bytes());
    h.update(b);
}

fn checksum_meta(meta: &BlockMeta, planes: &[PlaneSpec]) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    put_lp(&mut h, format::CHECKSUM_DOMAIN);
    h.update(&format::FORMAT_VERSION.to_le_bytes());
    h.update(meta.namespace.as_bytes());
    h.update(meta.key.as_bytes());
    h.update(&meta.parent);
    h.update(&meta.position.to_le_bytes());
    h.update(&meta.created_unix_ms.to_le_bytes());
    h.update(&(meta.tokens.len() as u64).to_le_bytes());
    for t in &meta.tokens {
        h.update(&t.to_le_bytes());
    }
    h.update(&(planes.len() as u64).to_le_bytes());
    h
}

/// Everything a plane contributes to the checksum before its bytes (which end with the
/// `u64` length of `lp(bytes)`).
fn checksum_plane_prefix(h: &mut blake3::Hasher, spec: &PlaneSpec, data_len: u64) {
    put_lp(h, spec.name.as_bytes());
    put_lp(h, spec.dtype.name().as_bytes());
    h.update(&(spec.shape.len() as u64).to_le_bytes());
    for d in &spec.shape {
        h.update(&d.to_le_bytes());
    }
    h.update(&data_len.to_le_bytes());
}

fn checksum_plane(h: &mut blake3::Hasher, spec: &PlaneSpec, data: &[u8]) {
    checksum_plane_prefix(h, spec, data.len() as u64);
    h.update(data);
}

/// The checksum of a block: blake3 over a canonical encoding of its metadata and planes
/// (docs/store-format.md, "Checksum").
pub fn checksum(block: &Block) -> [u8; 32] {
    let specs: Vec<PlaneSpec> = block.planes.iter().map(Plane::spec).collect();
    let mut h = checksum_meta(&block.meta, &specs);
    for (spec, p) in specs.iter().zip(&block.planes) {
        checksum_plane(&mut h, spec, &p.data);
    }
    *h.finalize().as_bytes()
}

fn join<T: ToString>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The safetensors `__metadata__` map of a block.
pub(crate) fn metadata_map(block: &Block, sum: &[u8; 32]) -> HashMap<String, String> {
    let m = &block.meta;
    let mut map = HashMap::new();
    map.insert(format::META_FORMAT.into(), format::FORMAT_NAME.into());
    map.insert(
        format::META_VERSION.into(),
        format::FORMAT_VERSION.to_string(),
    );
    map.insert(format::META_NAMESPACE.into(), m.namespace.to_string());
    map.insert(format::META_KEY.into(), m.key.to_string());
    map.insert(format::META_PARENT.into(), hex(&m.parent));
    map.insert(format::META_POSITION.into(), m.position.to_string());
    map.insert(format::META_TOKENS.into(), join(&m.tokens));
    map.insert(format::META_CREATED.into(), m.created_unix_ms.to_string());
    map.insert(
        format::META_PLANES.into(),
        join(block.planes.iter().map(|p| p.name.as_str())),
    );
    map.insert(
        format::META_CHECKSUM.into(),
        format!("{}{}", format::CHECKSUM_PREFIX, hex(sum)),
    );
    map
}

/// Why a block cannot be encoded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EncodeError {
    #[error("invalid block: {0}")]
    Invalid(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Rejects blocks the format cannot represent faithfully.
pub(crate) fn check_encodable(block: &Block) -> Result<(), EncodeError> {
    check_lengths(&block.planes).map_err(|e| EncodeError::Invalid(e.to_string()))?;
    let mut names = std::collections::HashSet::new();
    for p in &block.planes {
        if p.name.is_empty() || p.name.contains(',') || p.name == "__metadata__" {
            return Err(EncodeError::Invalid(format!(
                "plane name {:?} is empty, contains ',' or is reserved",
                p.name
            )));
        }
        if !names.insert(p.name.as_str()) {
            return Err(EncodeError::Invalid(format!(
                "plane name {:?} appears twice",
                p.name
            )));
        }
    }
    let computed = block_key(&block.meta.parent, &block.meta.tokens);
    if computed != block.meta.key {
        return Err(EncodeError::Invalid(format!(
            "key {} is not blake3(parent || tokens) = {computed}",
            block.meta.key
        )));
    }
    Ok(())
}

/// Upper bound on the encoded file length (header JSON is bounded by the metadata strings
/// and a fixed allowance per plane).
pub(crate) fn estimate_file_len(block: &Block) -> u64 {
    let meta_len: u64 = 1024 + 11 * block.meta.tokens.len() as u64;
    let planes: u64 = block
        .planes
        .iter()
        .map(|p| 128 + 2 * p.name.len() as u64 + 21 * p.shape.len() as u64)
        .sum();
    8 + meta_len + planes + 8 + block.data_len()
}

/// Header metadata (with the checksum) and named plane views: what safetensors serializes.
type Tensors<'a> = (
    Option<HashMap<String, String>>,
    Vec<(String, TensorView<'a>)>,
);

/// The safetensors header metadata (with the checksum) and the plane views of `block`.
fn tensors(block: &Block) -> Result<Tensors<'_>, EncodeError> {
    check_encodable(block)?;
    let sum = checksum(block);
    let meta = Some(metadata_map(block, &sum));
    let mut views = Vec::with_capacity(block.planes.len());
    for p in &block.planes {
        let shape: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
        let view = TensorView::new(p.dtype.to_safetensors(), shape, &p.data)
            .map_err(|e| EncodeError::Invalid(format!("plane {:?}: {e:?}", p.name)))?;
        views.push((p.name.clone(), view));
    }
    Ok((meta, views))
}

/// Writes `block` as a safetensors file to `out` (unbuffered writes are batched here) and
/// returns the bytes written. Does not sync.
///
/// The file is what `safetensors::serialize` writes: an 8-byte little-endian header length,
/// the JSON header padded with spaces to a multiple of 8, then the planes' bytes in the
/// format's order (descending dtype alignment, then name). Written here rather than by the
/// crate so that it streams into any [`Write`](std::io::Write) (the SSD tier's file system)
/// without first copying the block into one buffer.
pub(crate) fn write_to(block: &Block, out: impl std::io::Write) -> Result<u64, EncodeError> {
    use std::io::Write as _;
    let (meta, views) = tensors(block)?;
    let mut order: Vec<usize> = (0..views.len()).collect();
    order.sort_by(|&a, &b| {
        let (an, av) = &views[a];
        let (bn, bv) = &views[b];
        bv.dtype().cmp(&av.dtype()).then(an.cmp(bn))
    });
    let mut header = serde_json::Map::new();
    if let Some(meta) = meta {
        let meta: serde_json::Map<String, serde_json::Value> =
            meta.into_iter().map(|(k, v)| (k, v.into())).collect();
        header.insert("__metadata__".into(), meta.into());
    }
    let mut offset = 0;
    for &i in &order {
        let (name, view) = &views[i];
        let len = view.data().len();
        let info = safetensors::tensor::TensorInfo {
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            data_offsets: (offset, offset + len),
        };
        offset += len;
        let info = serde_json::to_value(info).map_err(|e| EncodeError::Invalid(e.to_string()))?;
        header.insert(name.clone(), info);
    }
    let mut header =
        serde_json::to_vec(&header).map_err(|e| EncodeError::Invalid(e.to_string()))?;
    header.resize(header.len().div_ceil(8) * 8, b' ');
    let mut w = std::io::BufWriter::new(out);
    w.write_all(&(header.len() as u64).to_le_bytes())?;
    w.write_all(&header)?;
    for &i in &order {
        w.write_all(views[i].1.data())?;
    }
    w.flush()?;
    Ok(8 + header.len() as u64 + offset as u64)
}

/// The exact bytes [`write_to`] writes for `block` (the remote tier stores these).
pub(crate) fn encode(block: &Block) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(estimate_file_len(block) as usize);
    write_to(block, &mut out)?;
    Ok(out)
}

/// Parses and verifies a whole block file held in memory (header, layout, checksum); the
/// planes share `bytes`.
pub(crate) fn decode(bytes: Bytes) -> Result<Block, DecodeError> {
    let layout = layout(&bytes)?;
    let mut h = layout_hasher(&layout);
    for (spec, range) in &layout.planes {
        checksum_plane(&mut h, spec, &bytes[range.clone()]);
    }
    finish(layout, h, bytes)
}

fn field<'a>(map: &'a HashMap<String, String>, key: &'static str) -> Result<&'a str, DecodeError> {
    map.get(key)
        .map(String::as_str)
        .ok_or(DecodeError::MissingField(key))
}

fn parse_hash(map: &HashMap<String, String>, key: &'static str) -> Result<[u8; 32], DecodeError> {
    let v = field(map, key)?;
    crate::ssd::parse_canonical::<BlockKey>(v)
        .map(|k| k.0)
        .ok_or_else(|| bad(key, v))
}

fn parse_num<T: std::str::FromStr>(
    map: &HashMap<String, String>,
    key: &'static str,
) -> Result<T, DecodeError> {
    let v = field(map, key)?;
    // Only canonical decimal: no sign, no leading zeros, so a flipped bit cannot alias.
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) || (v.len() > 1 && v.starts_with('0'))
    {
        return Err(bad(key, v));
    }
    v.parse().map_err(|_| bad(key, v))
}

struct ParsedMeta {
    meta: BlockMeta,
    plane_names: Vec<String>,
    checksum: [u8; 32],
}

fn parse_meta(map: Option<&HashMap<String, String>>) -> Result<ParsedMeta, DecodeError> {
    let Some(map) = map else {
        return Err(DecodeError::Foreign { found: None });
    };
    match map.get(format::META_FORMAT) {
        Some(f) if f == format::FORMAT_NAME => {}
        other => {
            return Err(DecodeError::Foreign {
                found: other.cloned(),
            })
        }
    }
    let version = field(map, format::META_VERSION)?;
    if version != format::FORMAT_VERSION.to_string() {
        return Err(DecodeError::UnsupportedVersion {
            found: version.chars().take(20).collect(),
        });
    }
    let tokens_s = field(map, format::META_TOKENS)?;
    let tokens = if tokens_s.is_empty() {
        Vec::new()
    } else {
        tokens_s
            .split(',')
            .map(|t| {
                if t.is_empty() || (t.len() > 1 && t.starts_with('0')) {
                    return Err(bad(format::META_TOKENS, tokens_s));
                }
                t.parse::<u32>()
                    .map_err(|_| bad(format::META_TOKENS, tokens_s))
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let planes_s = field(map, format::META_PLANES)?;
    let plane_names = if planes_s.is_empty() {
        Vec::new()
    } else {
        planes_s.split(',').map(str::to_owned).collect()
    };
    let sum_s = field(map, format::META_CHECKSUM)?;
    let sum = sum_s
        .strip_prefix(format::CHECKSUM_PREFIX)
        .and_then(crate::ssd::parse_canonical::<BlockKey>)
        .ok_or_else(|| bad(format::META_CHECKSUM, sum_s))?;
    let meta = BlockMeta {
        namespace: NamespaceId(parse_hash(map, format::META_NAMESPACE)?),
        key: BlockKey(parse_hash(map, format::META_KEY)?),
        parent: parse_hash(map, format::META_PARENT)?,
        position: parse_num(map, format::META_POSITION)?,
        tokens,
        created_unix_ms: parse_num(map, format::META_CREATED)?,
    };
    let computed = block_key(&meta.parent, &meta.tokens);
    if computed != meta.key {
        return Err(DecodeError::Key {
            stored: meta.key,
            computed,
        });
    }
    Ok(ParsedMeta {
        meta,
        plane_names,
        checksum: sum.0,
    })
}

/// A block file's parsed header: metadata and, in block order, each plane's layout and the
/// range of its bytes in the file.
struct Layout {
    header: BlockHeader,
    planes: Vec<(PlaneSpec, std::ops::Range<usize>)>,
}

/// Parses and checks the header of a block file whose whole length is `bytes.len()`; only
/// the first `8 + header length` bytes are read (the rest may not be filled in yet). The
/// checks are [`parse_header`]'s, so a file gives the same verdict whichever way it is read.
fn layout(bytes: &[u8]) -> Result<Layout, DecodeError> {
    let file_len = bytes.len() as u64;
    if bytes.len() < 8 {
        return Err(DecodeError::Truncated {
            needed: 8,
            found: file_len,
        });
    }
    let n = header_len(
        u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8])),
        file_len,
    )?;
    let data_start = 8 + n as usize;
    let (header, ranges) = parse_header_and_ranges(&bytes[8..data_start], file_len)?;
    let planes = header
        .planes
        .iter()
        .cloned()
        .zip(ranges)
        .map(|(spec, (s, e))| (spec, data_start + s as usize..data_start + e as usize))
        .collect();
    Ok(Layout { header, planes })
}

/// The checksum input before any plane byte.
fn layout_hasher(layout: &Layout) -> blake3::Hasher {
    let specs: Vec<PlaneSpec> = layout.planes.iter().map(|(s, _)| s.clone()).collect();
    checksum_meta(&layout.header.meta, &specs)
}

/// Checks the finished checksum and hands out the planes as slices of `file`, which holds
/// the whole file (no copy).
fn finish(layout: Layout, h: blake3::Hasher, file: Bytes) -> Result<Block, DecodeError> {
    let computed = *h.finalize().as_bytes();
    if computed != layout.header.checksum {
        return Err(DecodeError::Checksum {
            stored: hex(&layout.header.checksum),
            computed: hex(&computed),
        });
    }
    let planes: Vec<Plane> = layout
        .planes
        .into_iter()
        .map(|(spec, range)| Plane {
            name: spec.name,
            dtype: spec.dtype,
            shape: spec.shape,
            data: file.slice(range),
        })
        .collect();
    check_lengths(&planes)?;
    Ok(Block {
        meta: layout.header.meta,
        planes,
    })
}

/// Size of the reads of [`read_file`].
const READ_CHUNK: usize = 2 << 20;
/// Reads [`read_file`] keeps in flight while it hashes.
const READERS: usize = 4;

/// Reads a block file of `len` bytes with large `pread`s straight into one buffer that the
/// planes then share (no second copy), verifying the checksum as it goes: helper threads
/// keep [`READERS`] reads in flight while this one hashes the chunks that have arrived. The outer
/// error is an I/O failure (not evidence about the contents); the inner one a verification
/// failure (a file shorter than `len` by the time it is read counts as truncated).
pub(crate) fn read_file<R: ReadAt + ?Sized>(
    file: &R,
    len: u64,
) -> std::io::Result<Result<Block, DecodeError>> {
    read_file_in_chunks(file, len, READ_CHUNK)
}

pub(crate) fn read_file_in_chunks<R: ReadAt + ?Sized>(
    file: &R,
    len: u64,
    chunk_len: usize,
) -> std::io::Result<Result<Block, DecodeError>> {
    let truncated = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Ok(Err(DecodeError::Truncated {
            needed: len,
            found: file.len().unwrap_or(0),
        })),
        _ => Err(e),
    };
    if len < 8 {
        return Ok(Err(DecodeError::Truncated {
            needed: 8,
            found: len,
        }));
    }
    let Ok(ulen) = usize::try_from(len) else {
        return Ok(Err(DecodeError::Truncated {
            needed: 8,
            found: len,
        }));
    };
    let mut file_buffer = crate::block_buffers::FileBuffer::new(ulen);
    let buf = file_buffer.bytes_mut();
    if let Err(e) = file.read_exact_at(&mut buf[..8], 0) {
        return truncated(e);
    }
    let n = u64::from_le_bytes(buf[..8].try_into().unwrap_or([0; 8]));
    if n > format::MAX_HEADER_LEN || n + 8 > len {
        return Ok(Err(DecodeError::Truncated {
            needed: n.saturating_add(8),
            found: len,
        }));
    }
    let data_start = 8 + n as usize;
    if let Err(e) = file.read_exact_at(&mut buf[8..data_start], 8) {
        return truncated(e);
    }
    let layout = match layout(buf) {
        Ok(l) => l,
        Err(e) => return Ok(Err(e)),
    };
    let mut h = layout_hasher(&layout);
    let (_, data) = buf.split_at_mut(data_start);
    let data_len = data.len();
    if data_len <= chunk_len {
        if let Err(e) = file.read_exact_at(data, data_start as u64) {
            return truncated(e);
        }
        for (spec, range) in &layout.planes {
            checksum_plane(&mut h, spec, &buf[range.clone()]);
        }
        return Ok(finish(layout, h, file_buffer.into_bytes()));
    }
    let read = std::thread::scope(|scope| -> std::io::Result<()> {
        // READERS threads keep that many large reads in flight (the disk wants queue depth;
        // one buffered reader waits on each readahead window in turn) while this thread
        // hashes what has arrived, in order.
        let (tx, rx) = std::sync::mpsc::channel::<(usize, std::io::Result<&[u8]>)>();
        let mut lanes: Vec<Vec<(usize, &mut [u8])>> = (0..READERS).map(|_| Vec::new()).collect();
        for (i, chunk) in data.chunks_mut(chunk_len).enumerate() {
            lanes[i % READERS].push((i, chunk));
        }
        for lane in lanes {
            let tx = tx.clone();
            scope.spawn(move || {
                for (i, chunk) in lane {
                    let off = (data_start + i * chunk_len) as u64;
                    let r = file.read_exact_at(chunk, off);
                    let failed = r.is_err();
                    if tx.send((i, r.map(|()| &*chunk))).is_err() || failed {
                        return;
                    }
                }
            });
        }
        drop(tx);
        // Planes are hashed in block order, which is the file order unless dtypes of
        // different alignment are mixed (then some waiting).
        let mut chunks: Vec<Option<&[u8]>> = vec![None; data_len.div_ceil(chunk_len)];
        for (spec, range) in &layout.planes {
            checksum_plane_prefix(&mut h, spec, range.len() as u64);
            let (mut pos, end) = (range.start - data_start, range.end - data_start);
            while pos < end {
                let i = pos / chunk_len;
                let chunk = loop {
                    if let Some(c) = chunks[i] {
                        break c;
                    }
                    match rx.recv() {
                        Ok((j, r)) => chunks[j] = Some(r?),
                        Err(_) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    }
                };
                let within = pos - i * chunk_len;
                let take = (end - pos).min(chunk.len() - within);
                h.update(&chunk[within..within + take]);
                pos += take;
            }
        }
        Ok(())
    });
    if let Err(e) = read {
        return truncated(e);
    }
    Ok(finish(layout, h, file_buffer.into_bytes()))
}

#[derive(serde::Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Why a header could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HeaderError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// Reads and checks a block file's header without reading the plane bytes: format, version,
/// key derivation, and that the tensors exactly fill the rest of the file. Does not verify
/// the checksum.
pub(crate) fn read_header(path: &Path) -> Result<BlockHeader, HeaderError> {
    let mut f = crate::nofollow::open_read(path)?;
    let file_len = f.metadata()?.len();
    let mut len8 = [0u8; 8];
    if file_len < 8 {
        return Err(DecodeError::Truncated {
            needed: 8,
            found: file_len,
        }
        .into());
    }
    f.read_exact(&mut len8)?;
    let n = header_len(u64::from_le_bytes(len8), file_len)?;
    let mut raw = vec![0u8; n as usize];
    f.read_exact(&mut raw)?;
    Ok(parse_header(&raw, file_len)?)
}

/// Checks a header length `n` read from a file of `file_len` bytes.
pub(crate) fn header_len(n: u64, file_len: u64) -> Result<u64, DecodeError> {
    if n > format::MAX_HEADER_LEN || n + 8 > file_len {
        return Err(DecodeError::Truncated {
            needed: n.saturating_add(8),
            found: file_len,
        });
    }
    Ok(n)
}

/// Parses the header JSON `raw` (the `n` bytes after the length) of a block file of
/// `file_len` bytes: [`read_header`] without the I/O.
pub(crate) fn parse_header(raw: &[u8], file_len: u64) -> Result<BlockHeader, DecodeError> {
    parse_header_and_ranges(raw, file_len).map(|(header, _)| header)
}

/// [`parse_header`], with each plane's byte range in the data section, in block order.
fn parse_header_and_ranges(
    raw: &[u8],
    file_len: u64,
) -> Result<(BlockHeader, Vec<(u64, u64)>), DecodeError> {
    let n = raw.len() as u64;
    // Ordered maps: the first bad tensor reported is the same on every read.
    let mut map: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(raw)
            .map_err(|e| DecodeError::Safetensors(format!("header JSON: {e}")))?;
    let meta_map: Option<HashMap<String, String>> = match map.remove("__metadata__") {
        None => None,
        Some(v) => Some(
            serde_json::from_value(v)
                .map_err(|e| DecodeError::Safetensors(format!("__metadata__: {e}")))?,
        ),
    };
    let parsed = parse_meta(meta_map.as_ref())?;
    let mut tensors: std::collections::BTreeMap<String, RawTensor> = Default::default();
    for (name, v) in map {
        let t: RawTensor = serde_json::from_value(v)
            .map_err(|e| DecodeError::Safetensors(format!("tensor {name:?}: {e}")))?;
        tensors.insert(name, t);
    }
    if tensors.len() != parsed.plane_names.len() {
        return Err(DecodeError::Planes(format!(
            "metadata lists {} planes, the file holds {} tensors",
            parsed.plane_names.len(),
            tensors.len()
        )));
    }
    let mut planes = Vec::new();
    let mut ranges = Vec::new();
    for name in &parsed.plane_names {
        let t = tensors
            .get(name)
            .ok_or_else(|| DecodeError::Planes(format!("plane {name:?} is not in the file")))?;
        let dtype = Dtype::from_name(&t.dtype).ok_or_else(|| DecodeError::UnsupportedDtype {
            plane: name.clone(),
            dtype: t.dtype.clone(),
        })?;
        let spec = PlaneSpec::new(name.clone(), dtype, t.shape.clone());
        let [start, end] = t.data_offsets;
        if end < start || Some(end - start) != spec.byte_len() {
            return Err(DecodeError::Planes(format!(
                "plane {name:?} offsets {start}..{end} do not match its dtype and shape"
            )));
        }
        ranges.push((start, end));
        planes.push(spec);
    }
    let mut sorted = ranges.clone();
    sorted.sort_unstable();
    let mut expect = 0;
    for (start, end) in sorted {
        if start != expect {
            return Err(DecodeError::Planes(
                "tensor data has gaps or overlaps".into(),
            ));
        }
        expect = end;
    }
    let data_len = expect;
    // Offsets are attacker-sized u64s: the sum may not fit.
    let needed = (8 + n).checked_add(data_len);
    if needed != Some(file_len) {
        return Err(DecodeError::Truncated {
            needed: needed.unwrap_or(u64::MAX),
            found: file_len,
        });
    }
    let header = BlockHeader {
        meta: parsed.meta,
        planes,
        checksum: parsed.checksum,
        data_len,
        file_len,
    };
    Ok((header, ranges))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Block {
        let ns = NamespaceId([3; 32]);
        let meta = BlockMeta {
            created_unix_ms: 1_700_000_000_000,
            ..BlockMeta::new(ns, ns.0, 0, vec![5, 6, 7, 8])
        };
        let k: Vec<u8> = (0..32).collect();
        let v: Vec<u8> = (100..116).collect();
        Block {
            meta,
            planes: vec![
                Plane::new("l0.k", Dtype::F32, vec![2, 4], k),
                Plane::new("l0.v", Dtype::BF16, vec![2, 4], v),
            ],
        }
    }

    fn encode(block: &Block) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b");
        let f = std::fs::File::create(&p).unwrap();
        let written = write_to(block, f).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(written, bytes.len() as u64);
        bytes
    }

    /// Reads `bytes` back through the file path, in one read and in 16-byte chunks (so the
    /// pipelined path runs, with planes spanning chunks).
    fn decode(bytes: &[u8]) -> Result<Block, DecodeError> {
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, bytes).unwrap();
        let whole = read_file(&f, bytes.len() as u64).unwrap();
        let chunked = read_file_in_chunks(&f, bytes.len() as u64, 16).unwrap();
        assert_eq!(whole, chunked);
        whole
    }

    #[test]
    fn written_files_are_what_the_safetensors_crate_reads_and_writes() {
        let b = sample();
        let ours = encode(&b);
        let theirs = {
            let (meta, views) = tensors(&b).unwrap();
            safetensors::serialize(views, &meta).unwrap()
        };
        assert_eq!(ours.len(), theirs.len());
        let parsed = safetensors::SafeTensors::deserialize(&ours).unwrap();
        for p in &b.planes {
            let t = parsed.tensor(&p.name).unwrap();
            assert_eq!(t.data(), &p.data[..]);
            assert_eq!(t.dtype(), p.dtype.to_safetensors());
        }
        // Same plane order in the file: the data sections are identical.
        let data = |bytes: &[u8]| {
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            bytes[8 + n..].to_vec()
        };
        assert_eq!(data(&ours), data(&theirs));
        assert_eq!(decode(&ours).unwrap(), decode(&theirs).unwrap());
    }

    #[test]
    fn round_trip_keeps_plane_order_and_bytes() {
        let b = sample();
        let bytes = encode(&b);
        assert!(bytes.len() as u64 <= estimate_file_len(&b));
        assert_eq!(decode(&bytes).unwrap(), b);
    }

    #[test]
    fn chunked_reads_hash_planes_in_block_order_even_when_the_file_order_differs() {
        let mut b = sample();
        // BF16 first in block order; the writer puts the F32 plane first in the file.
        b.planes.reverse();
        let bytes = encode(&b);
        assert_eq!(decode(&bytes).unwrap(), b);
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, &bytes).unwrap();
        // A file that shrank after its length was taken is truncated, not an I/O error.
        let long = read_file_in_chunks(&f, bytes.len() as u64 + 100, 16).unwrap();
        assert!(long.is_err());
    }

    /// Every single-bit flip anywhere in a block file is detected.
    #[test]
    fn every_bit_flip_is_detected() {
        let bytes = encode(&sample());
        for i in 0..bytes.len() * 8 {
            let mut c = bytes.clone();
            c[i / 8] ^= 1 << (i % 8);
            assert!(decode(&c).is_err(), "flip of bit {i} went undetected");
        }
    }

    /// Plane offsets near `u64::MAX` once overflowed the header length check.
    #[test]
    fn header_with_offsets_past_u64_max_is_refused() {
        let bytes = encode(&sample());
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let huge = u64::MAX - 40;
        header["l0.k"]["dtype"] = "U8".into();
        header["l0.k"]["shape"] = serde_json::json!([huge]);
        header["l0.k"]["data_offsets"] = serde_json::json!([0, huge]);
        header["l0.v"]["data_offsets"] = serde_json::json!([huge, huge + 16]);
        let raw = serde_json::to_vec(&header).unwrap();
        let file_len = 8 + raw.len() as u64;
        assert!(matches!(
            parse_header(&raw, file_len),
            Err(DecodeError::Truncated {
                needed: u64::MAX,
                ..
            })
        ));
    }

    #[test]
    fn every_truncation_is_detected() {
        let bytes = encode(&sample());
        for len in 0..bytes.len() {
            assert!(
                decode(&bytes[..len]).is_err(),
                "truncation to {len} accepted"
            );
        }
    }
}
