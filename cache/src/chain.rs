//! [`Chain`]: the block keys of one sequence, derived once as its tokens arrive.

use store::{block_key, BlockKey, BlockMeta, NamespaceId};

/// The chain keys of a sequence's full blocks in a namespace: key `i` names block `i` by
/// its whole prefix (`blake3(key[i-1] || tokens of block i)`, root = the namespace id).
///
/// A request derives its keys here once: the device pool's match, the store's lookup and
/// load, and publication all read them from this one chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    namespace: NamespaceId,
    block_size: usize,
    keys: Vec<BlockKey>,
}

impl Chain {
    /// An empty chain in `namespace` for blocks of `block_size` tokens.
    pub fn new(namespace: NamespaceId, block_size: usize) -> Self {
        Self {
            namespace,
            block_size: block_size.max(1),
            keys: Vec::new(),
        }
    }

    /// The chain of `tokens`' full blocks.
    pub fn of(namespace: NamespaceId, block_size: usize, tokens: &[u32]) -> Self {
        let mut c = Self::new(namespace, block_size);
        c.extend(tokens);
        c
    }

    /// Derives the keys of the full blocks of `tokens` (the whole sequence so far, of which
    /// the blocks already keyed are a prefix) not keyed yet.
    pub fn extend(&mut self, tokens: &[u32]) {
        let bs = self.block_size;
        for i in self.keys.len()..tokens.len() / bs {
            let key = block_key(&self.parent(i), &tokens[i * bs..(i + 1) * bs]);
            self.keys.push(key);
        }
    }

    /// Keeps the first `blocks` keys.
    pub fn truncate(&mut self, blocks: usize) {
        self.keys.truncate(blocks);
    }

    /// The namespace.
    pub fn namespace(&self) -> NamespaceId {
        self.namespace
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The keys, root first.
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// The parent of block `position`: the key before it, or the namespace id.
    pub fn parent(&self, position: usize) -> [u8; 32] {
        match position.checked_sub(1) {
            None => *self.namespace.as_bytes(),
            Some(p) => *self.keys[p].as_bytes(),
        }
    }

    /// The metadata of block `position` (which must be keyed), holding `tokens`.
    pub(crate) fn meta(&self, position: usize, tokens: &[u32]) -> BlockMeta {
        let meta = BlockMeta::new(
            self.namespace,
            self.parent(position),
            position as u32,
            tokens.to_vec(),
        );
        debug_assert_eq!(meta.key, self.keys[position]);
        meta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extending_in_steps_gives_the_keys_of_one_derivation() {
        let ns = NamespaceId([7; 32]);
        let tokens: Vec<u32> = (0..23).collect();
        let mut c = Chain::new(ns, 4);
        c.extend(&tokens[..6]);
        assert_eq!(c.keys().len(), 1);
        c.extend(&tokens);
        assert_eq!(c.keys(), store::chain_keys(ns, &tokens, 4).as_slice());
    }
}
