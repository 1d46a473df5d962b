//! A registered provider of block-file buffers: blocks read from the SSD live in its
//! buffers (no copy), and every byte still verifies.

use std::sync::{Arc, Mutex};

use store::{BlockBuffer, BlockBuffers, Store, StoreConfig, Tier};

use crate::common;

/// The address ranges of the provider's live buffers.
static LIVE: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

struct Provider;

struct Buffer(Vec<u8>);

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl AsMut<[u8]> for Buffer {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl BlockBuffer for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        let at = self.0.as_ptr() as usize;
        LIVE.lock().unwrap().retain(|(a, _)| *a != at);
    }
}

impl BlockBuffers for Provider {
    fn buffer(&self, len: usize) -> Option<Box<dyn BlockBuffer>> {
        // Garbage first: the reader must overwrite every byte it hands on.
        let b = Buffer(vec![0xA5; len]);
        LIVE.lock().unwrap().push((b.0.as_ptr() as usize, len));
        Some(Box::new(b))
    }
}

fn in_a_live_buffer(bytes: &[u8]) -> bool {
    let (p, n) = (bytes.as_ptr() as usize, bytes.len());
    LIVE.lock()
        .unwrap()
        .iter()
        .any(|(a, len)| p >= *a && p + n <= a + len)
}

#[test]
fn blocks_read_from_the_ssd_live_in_the_registered_buffers_and_verify() {
    // Registered for the whole test process: other tests' reads use it too, which changes
    // only where their bytes live.
    store::set_block_buffers(Box::new(Provider));
    let dir = tempfile::tempdir().unwrap();
    let d = common::desc("lent-buffers", 4);
    let (blocks, toks) = common::chain(&d, 4, 11);
    let keys: Vec<store::BlockKey> = blocks.iter().map(|b| b.meta.key).collect();
    {
        let s = Store::open(StoreConfig::default().root(dir.path())).unwrap();
        s.register_namespace(&d).unwrap();
        for b in &blocks {
            s.insert(Arc::new(b.clone())).unwrap();
        }
        s.flush().unwrap();
    }
    // A restart: the RAM tier is empty, every block comes from its file.
    let s = Store::open(StoreConfig::default().root(dir.path())).unwrap();
    let ns = s.register_namespace(&d).unwrap();
    let loaded = s.load_prefix(ns, &keys, &toks);
    assert!(loaded.stopped.is_none(), "{:?}", loaded.stopped);
    assert_eq!(loaded.blocks.len(), blocks.len());
    for ((got, tier), want) in loaded.blocks.iter().zip(&blocks) {
        assert_eq!(*tier, Tier::Ssd);
        assert_eq!(**got, *want, "the bytes read into a lent buffer");
        for p in &got.planes {
            assert!(
                in_a_live_buffer(&p.data),
                "plane {} is not in a lent buffer",
                p.name
            );
        }
    }
}
