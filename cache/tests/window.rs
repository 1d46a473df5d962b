//! Window-trimmed blocks: which blocks publication trims, the bytes that saves (exact
//! arithmetic), restores that stop where a window would read a trimmed block, trims that a
//! restored cache refuses, and the trimmed copies of blocks a sequence moved past.

use cache::{CacheError, Chain, KvCache, KvFormat, PagedConfig, PagedKvCache};
use mlx::Array;
use store::{Block, NamespaceId};

const H: usize = 2;
const D: usize = 64;
const BS: usize = 4;
const WINDOW: usize = 8;
/// Layer 0 global, layers 1 and 2 with a window of 8 keys.
const WINDOWS: [Option<usize>; 3] = [None, Some(WINDOW), Some(WINDOW)];

fn config() -> PagedConfig {
    PagedConfig {
        block_size: BS,
        format: KvFormat::Float,
        initial_blocks: 2,
        max_blocks: 1024,
    }
}

/// Keys (and values) of layer `l` for positions `from..to`: every element is
/// `1000 · l + position + 1`, so a zero is never a real key.
fn kv(l: usize, from: usize, to: usize) -> Array {
    let data: Vec<f32> = (0..H)
        .flat_map(|_| (from..to).flat_map(|p| std::iter::repeat_n((1000 * l + p + 1) as f32, D)))
        .collect();
    Array::from_slice(&data, &[1, H as i32, (to - from) as i32, D as i32]).unwrap()
}

fn fill(cache: &mut PagedKvCache, from: usize, to: usize) {
    for l in 0..WINDOWS.len() {
        let a = kv(l, from, to);
        cache.update_and_fetch(l, &a, &a).unwrap();
    }
}

/// The value each position of layer `l` holds (first element of head 0).
fn positions(cache: &PagedKvCache, l: usize) -> Vec<f32> {
    let (k, _) = cache.fetch(l).unwrap().unwrap();
    let len = k.shape()[2] as usize;
    let all: Vec<f32> = k.to_vec::<f32>().unwrap();
    (0..len).map(|p| all[p * D]).collect()
}

fn windowed() -> PagedKvCache {
    PagedKvCache::new(WINDOWS.len(), config())
        .unwrap()
        .with_windows(&WINDOWS)
        .unwrap()
}

fn published(tokens: &[u32]) -> (Chain, PagedKvCache, Vec<Block>) {
    let mut chain = Chain::new(NamespaceId([7; 32]), BS);
    let mut cache = windowed();
    fill(&mut cache, 0, tokens.len());
    let blocks = cache.publish(&mut chain, tokens).unwrap();
    (chain, cache, blocks)
}

#[test]
fn publication_trims_exactly_the_blocks_no_window_reads() {
    let tokens: Vec<u32> = (0..40).collect();
    let (_, _, blocks) = published(&tokens);
    // A continuation from 40 reads positions 33..39, one from 36 (the block boundary
    // before) 29..35: blocks 7, 8 and 9 keep their window planes, blocks 0..7 carry
    // layer 0's only.
    let planes: Vec<usize> = blocks.iter().map(|b| b.planes.len()).collect();
    assert_eq!(planes, [2, 2, 2, 2, 2, 2, 2, 6, 6, 6]);
    assert!(blocks[0]
        .planes
        .iter()
        .all(|p| p.name.starts_with("layers.0.")));
    // Bytes: a plane is H · BS · D f32 = 2,048 bytes; 10 whole blocks would be 10 · 6
    // planes, the trimmed run is 3 · 6 + 7 · 2 planes.
    let plane = (H * BS * D * 4) as u64;
    let written: u64 = blocks.iter().map(Block::data_len).sum();
    assert_eq!(written, (3 * 6 + 7 * 2) * plane);
    assert_eq!(10 * 6 * plane - written, 7 * 4 * plane);

    // A cache that does not know its windows publishes every plane.
    let mut chain = Chain::new(NamespaceId([7; 32]), BS);
    let mut plain = PagedKvCache::new(WINDOWS.len(), config()).unwrap();
    fill(&mut plain, 0, 40);
    let whole = plain.publish(&mut chain, &tokens).unwrap();
    assert!(whole.iter().all(|b| b.planes.len() == 6));
}

#[test]
fn a_restore_stops_where_a_window_would_read_a_trimmed_block() {
    let tokens: Vec<u32> = (0..40).collect();
    let (_, original, blocks) = published(&tokens);

    // The whole chain: layers 1 and 2 hold zeros before 28 (never read from 36 on), the
    // real keys after, layer 0 everything.
    let restored = windowed().restore_onto(&blocks).unwrap();
    assert_eq!((restored.blocks, restored.window_cut), (10, 0));
    let cache = restored.cache;
    assert_eq!(cache.window_floor(), 28);
    assert_eq!(positions(&cache, 0), positions(&original, 0));
    for l in 1..3 {
        let (got, want) = (positions(&cache, l), positions(&original, l));
        assert!(got[..28].iter().all(|&x| x == 0.0));
        assert_eq!(got[28..], want[28..]);
    }
    // The chain up to the block before the end (a prompt resent whole) restores too.
    let restored = windowed().restore_onto(&blocks[..9]).unwrap();
    assert_eq!((restored.blocks, restored.window_cut), (9, 0));

    // A prefix ending inside the trimmed part: every end would read a trimmed block.
    let restored = windowed().restore_onto(&blocks[..6]).unwrap();
    assert_eq!((restored.blocks, restored.window_cut), (0, 6));
    assert_eq!(restored.cache.offset(), 0);

    // A cache that does not know its windows refuses trimmed blocks as a layout mismatch.
    let plain = PagedKvCache::new(3, config()).unwrap();
    let restored = plain.restore_onto(&blocks).unwrap();
    assert_eq!(restored.blocks, 0);
    assert!(matches!(
        restored.stopped,
        Some(CacheError::Restore { position: 0, .. })
    ));
}

#[test]
fn a_restored_cache_never_trims_back_to_where_its_window_keys_are_zeros() {
    let tokens: Vec<u32> = (0..40).collect();
    let (_, _, blocks) = published(&tokens);
    let mut cache = windowed().restore_onto(&blocks).unwrap().cache;
    // From 35 a query reads 28..34: all real. From 34 it would read 27, a zero.
    assert_eq!(cache.rewind_point(35), 35);
    assert_eq!(cache.rewind_point(34), 0);
    assert!(matches!(
        cache.trim(6),
        Err(CacheError::WindowRewind { floor: 28, .. })
    ));
    assert_eq!(cache.offset(), 40);
    assert_eq!(cache.trim(5).unwrap(), 5);
    // Everything can go: an empty cache has no zeros.
    assert_eq!(cache.trim(35).unwrap(), 35);
    assert_eq!(cache.window_floor(), 0);
}

#[test]
fn blocks_a_sequence_moved_past_get_trimmed_copies_under_their_keys() {
    let tokens: Vec<u32> = (0..52).collect();
    let (mut chain, mut cache, first) = published(&tokens[..40]);
    assert!(cache
        .window_trimmed(&chain, &tokens[..40])
        .unwrap()
        .is_none());
    fill(&mut cache, 40, 52);
    let next = cache.publish(&mut chain, &tokens).unwrap();
    // From 52 a query reads 45..51, from 48 41..47: blocks 10, 11, 12 keep their window
    // planes.
    let planes: Vec<usize> = next.iter().map(|b| b.planes.len()).collect();
    assert_eq!(planes, [6, 6, 6]);
    // Blocks 7, 8 and 9 were stored whole: trimmed copies replace them.
    let export = cache.window_trimmed(&chain, &tokens).unwrap().unwrap();
    assert!(export.replaces());
    let trimmed = export.into_blocks().unwrap();
    let at: Vec<u32> = trimmed.iter().map(|b| b.meta.position).collect();
    assert_eq!(at, [7, 8, 9]);
    for b in &trimmed {
        assert_eq!(b.planes.len(), 2);
        assert_eq!(b.meta.key, chain.keys()[b.meta.position as usize]);
        assert_eq!(
            b.planes[0].data,
            first[b.meta.position as usize].planes[0].data
        );
    }
    assert!(cache.window_trimmed(&chain, &tokens).unwrap().is_none());

    // A request resumed at 24 publishes that end's window again, whole.
    let (mut chain, mut cache, _) = published(&tokens[..40]);
    cache.set_restorable_ends(&[24]);
    cache.republish_window(24);
    let again = cache.publish(&mut chain, &tokens[..40]).unwrap();
    let at: Vec<(u32, usize)> = again
        .iter()
        .map(|b| (b.meta.position, b.planes.len()))
        .collect();
    assert_eq!(at[..5], [(3, 6), (4, 6), (5, 6), (6, 2), (7, 6)]);

    // A restorable end set before publication keeps that end's window as well.
    let (mut chain, mut cache, _) = published(&tokens[..40]);
    cache.set_restorable_ends(&[40]);
    fill(&mut cache, 40, 52);
    cache.publish(&mut chain, &tokens).unwrap();
    assert!(cache.window_trimmed(&chain, &tokens).unwrap().is_none());
}

#[test]
fn quantized_trimmed_blocks_restore_the_real_keys_exactly() {
    for format in [KvFormat::KV8, KvFormat::KV4] {
        let config = PagedConfig { format, ..config() };
        let new = || {
            PagedKvCache::new(WINDOWS.len(), config)
                .unwrap()
                .with_windows(&WINDOWS)
                .unwrap()
        };
        let tokens: Vec<u32> = (0..40).collect();
        let mut chain = Chain::new(NamespaceId([9; 32]), BS);
        let mut original = new();
        fill(&mut original, 0, 40);
        let blocks = original.publish(&mut chain, &tokens).unwrap();
        // 3 planes per part (values, scales, biases): 6 per layer, 18 whole, 6 trimmed.
        let planes: Vec<usize> = blocks.iter().map(|b| b.planes.len()).collect();
        assert_eq!(planes, [6, 6, 6, 6, 6, 6, 6, 18, 18, 18], "{format:?}");
        let restored = new().restore_onto(&blocks).unwrap();
        assert_eq!(restored.blocks, 10, "{format:?}");
        let cache = restored.cache;
        assert_eq!(positions(&cache, 0), positions(&original, 0), "{format:?}");
        for l in 1..3 {
            let (got, want) = (positions(&cache, l), positions(&original, l));
            assert!(got[..28].iter().all(|&x| x == 0.0), "{format:?}");
            assert_eq!(got[28..], want[28..], "{format:?}");
        }
    }
}
