//! The int8 dot-product peak this CPU reaches: independent `vpdpbusd` chains on registers, no
//! memory traffic — the ceiling the int8 GEMM is measured against (benches/bench_cpu_peers.py).

use std::time::Instant;

use super::isa::Isa;
use super::pool::{split, ThreadCount};

/// Int8 operations (a multiply and an add per byte pair) per second on `threads` threads, from
/// `iterations` rounds of 16 independent dot products per thread; None without AVX-512 VNNI.
pub fn int8_peak_ops(threads: ThreadCount, iterations: usize) -> Option<f64> {
    if !Isa::Avx512Vnni.supported() {
        return None;
    }
    let start = Instant::now();
    split(threads, threads.get(), |_| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 VNNI was detected.
        unsafe {
            std::hint::black_box(x86::chains(iterations));
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    // 16 chains x 64 byte pairs x 2 operations per round and thread.
    Some((threads.get() * iterations * 16 * 64 * 2) as f64 / seconds)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn chains(iterations: usize) -> i32 {
        let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
        let mut acc = [_mm512_setzero_si512(); 16];
        for _ in 0..iterations {
            for x in acc.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        let mut total = _mm512_setzero_si512();
        for x in acc {
            total = _mm512_add_epi32(total, x);
        }
        _mm512_reduce_add_epi32(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_positive_where_vnni_is() {
        let peak = int8_peak_ops(ThreadCount::new(1), 1000);
        assert_eq!(peak.is_some(), Isa::Avx512Vnni.supported());
        assert!(peak.is_none_or(|p| p > 0.0));
    }
}
