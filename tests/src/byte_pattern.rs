//! The data of the checks that move bytes unchanged (point-to-point, the all-to-all family): byte
//! `i` of message `tag` from rank `src` to rank `dst` is a hash of (case key, src, dst, tag, i), so
//! a receiver computes what it must get without any exchange, and a message delivered to the wrong
//! place or out of order shows up as wrong bytes. Filling and comparing run in parallel chunks over
//! the cores this rank may use, so a 1 GiB message is checked in well under a second of host time.

use std::thread;

/// The stream key of one message: what [`fill`] and [`byte`] take.
pub fn message_key(case: u64, src: usize, dst: usize, tag: usize) -> u64 {
    let k = case ^ ((src as u64) << 40) ^ ((dst as u64) << 48) ^ ((tag as u64) << 56);
    k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// Byte `i` of the message with stream key `key` (an odd multiplier, so every byte position of a
/// message differs from its neighbours somewhere).
pub fn byte(key: u64, i: usize) -> u8 {
    (key.wrapping_mul(i as u64 + 1) >> 56) as u8
}

/// Slices shorter than this are one piece.
const PARALLEL_BYTES: usize = 4 << 20;

/// Bytes of each piece a slice of `len` bytes is cut into: one per core this rank may use.
fn piece_bytes(len: usize) -> usize {
    let cores = thread::available_parallelism().map_or(1, |c| c.get());
    if len < PARALLEL_BYTES {
        len.max(1)
    } else {
        len.div_ceil(cores)
    }
}

/// Writes the message with stream key `key` into `out` (its bytes 0..out.len()).
pub fn fill(out: &mut [u8], key: u64) {
    let per = piece_bytes(out.len());
    thread::scope(|s| {
        for (p, piece) in out.chunks_mut(per).enumerate() {
            s.spawn(move || {
                // `byte` by increments: key * (i + 1) steps by key (a vectorisable induction).
                let mut x = key.wrapping_mul((p * per) as u64 + 1);
                for b in piece {
                    *b = (x >> 56) as u8;
                    x = x.wrapping_add(key);
                }
            });
        }
    });
}

/// Where `got` differs from `want` (same length): the first index and how many bytes in all.
pub fn differences(got: &[u8], want: &[u8]) -> Option<(usize, usize)> {
    assert_eq!(got.len(), want.len(), "compared buffers differ in length");
    let per = piece_bytes(got.len());
    let found: Vec<(usize, usize)> = thread::scope(|s| {
        let pieces: Vec<_> = got
            .chunks(per)
            .zip(want.chunks(per))
            .enumerate()
            .map(|(p, (g, w))| {
                s.spawn(move || {
                    // Whole blocks compare as memcmp; only a differing one is searched by byte.
                    const BLOCK: usize = 4096;
                    let block = g
                        .chunks(BLOCK)
                        .zip(w.chunks(BLOCK))
                        .position(|(a, b)| a != b)?;
                    let (g, w) = (&g[block * BLOCK..], &w[block * BLOCK..]);
                    let first = g.iter().zip(w).position(|(a, b)| a != b)?;
                    let wrong = g.iter().zip(w).filter(|(a, b)| a != b).count();
                    Some((p * per + block * BLOCK + first, wrong))
                })
            })
            .collect();
        pieces
            .into_iter()
            .filter_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let first = found.first()?.0;
    Some((first, found.iter().map(|&(_, w)| w).sum()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_differ_by_every_part_of_their_key() {
        let msg = |k: u64| (0..16).map(|i| byte(k, i)).collect::<Vec<_>>();
        let base = msg(message_key(1, 0, 1, 0));
        for other in [
            message_key(2, 0, 1, 0),
            message_key(1, 1, 0, 0),
            message_key(1, 0, 2, 0),
            message_key(1, 0, 1, 1),
        ] {
            assert_ne!(base, msg(other));
        }
        assert!(base.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn parallel_fill_matches_the_byte_function() {
        let key = message_key(7, 3, 5, 2);
        let mut big = vec![0u8; PARALLEL_BYTES * 2 + 13];
        fill(&mut big, key);
        assert!(big.iter().enumerate().all(|(i, &b)| b == byte(key, i)));
    }

    #[test]
    fn differences_find_the_first_and_count_all() {
        let mut want = vec![0u8; PARALLEL_BYTES * 3 + 5];
        fill(&mut want, 99);
        let mut got = want.clone();
        assert_eq!(differences(&got, &want), None);
        for at in [PARALLEL_BYTES * 2 + 1, 17, want.len() - 1] {
            got[at] ^= 1;
        }
        assert_eq!(differences(&got, &want), Some((17, 3)));
    }
}
