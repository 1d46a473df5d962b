//! Where the store puts the bytes of the block files it reads: ordinary memory, unless the
//! process has registered buffers of its own ([`set_block_buffers`]). An engine on a GPU
//! registers page-locked memory the device reads in place, so that a block loaded from the
//! SSD restores without being assembled on the host (cache/src/block_memory.rs). The store
//! itself stays free of any device: it only asks for bytes and hands them to the planes.

use std::sync::OnceLock;

use bytes::Bytes;

/// A provider of buffers for block files, registered once per process.
pub trait BlockBuffers: Send + Sync {
    /// A buffer of exactly `len` bytes (contents unspecified), or `None` for ordinary
    /// memory (no room left, or `len` too large for the provider).
    fn buffer(&self, len: usize) -> Option<Box<dyn BlockBuffer>>;
}

/// One buffer of a [`BlockBuffers`]: plain host bytes, owned until dropped.
pub trait BlockBuffer: AsRef<[u8]> + AsMut<[u8]> + Send + 'static {}

/// The process's provider, if one was registered.
static BUFFERS: OnceLock<Box<dyn BlockBuffers>> = OnceLock::new();

/// Registers the provider of block files' buffers for the rest of the process; `false`
/// where one was registered already (the first stays).
pub fn set_block_buffers(buffers: Box<dyn BlockBuffers>) -> bool {
    BUFFERS.set(buffers).is_ok()
}

/// The buffer one block file is read into.
pub(crate) enum FileBuffer {
    Heap(Vec<u8>),
    Lent(Box<dyn BlockBuffer>),
}

impl FileBuffer {
    /// `len` bytes from the registered provider, else ordinary memory.
    pub(crate) fn new(len: usize) -> Self {
        BUFFERS
            .get()
            .and_then(|b| b.buffer(len))
            .filter(|b| (**b).as_ref().len() == len)
            .map_or_else(|| FileBuffer::Heap(vec![0u8; len]), FileBuffer::Lent)
    }

    /// The bytes, to read into.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            FileBuffer::Heap(v) => v,
            FileBuffer::Lent(b) => (**b).as_mut(),
        }
    }

    /// The buffer as the planes' shared bytes (no copy).
    pub(crate) fn into_bytes(self) -> Bytes {
        match self {
            FileBuffer::Heap(v) => Bytes::from(v),
            FileBuffer::Lent(b) => Bytes::from_owner(Lent(b)),
        }
    }
}

/// A lent buffer as the owner of `Bytes`.
struct Lent(Box<dyn BlockBuffer>);

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}
