//! The instruction set the CPU kernels run on: detected once at run time, and lowered (never
//! raised) by the `AIENG_CPU_ISA` environment variable, for tests and comparisons.

use std::fmt;
use std::sync::OnceLock;

use super::KernelError;

/// The environment variable that forces a lower path: `avx512vnni`, `avxvnni`, `avx2`, `scalar`.
pub const ISA_ENV: &str = "AIENG_CPU_ISA";

/// The int8 dot-product paths, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust, any CPU.
    Scalar,
    /// 256-bit AVX2 + FMA: `vpmaddubsw` + `vpmaddwd` stand in for the dot product.
    Avx2,
    /// 256-bit AVX-VNNI `vpdpbusd` (VEX encoded: Alder Lake, Zen 5).
    AvxVnni,
    /// 512-bit AVX-512 VNNI `vpdpbusd` (+ AVX-512 BW).
    Avx512Vnni,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    pub fn parse(name: &str) -> Result<Isa, KernelError> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name() == name.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                KernelError::InvalidArgument(format!(
                    "unknown CPU instruction set {name:?} (one of avx512vnni, avxvnni, avx2, \
                     scalar)"
                ))
            })
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.supported() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                    && Isa::Avx2.supported()
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every path this CPU can run, lowest first.
    pub fn supported_paths() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.supported()).collect()
    }

    /// The best path this CPU has.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.supported())
            .unwrap_or(Isa::Scalar)
    }

    /// The best path, or the one `requested` names when it is lower (a higher one than the CPU
    /// has is an error, not a silent fallback).
    pub fn choose(requested: Option<&str>) -> Result<Isa, KernelError> {
        let best = Isa::best();
        let Some(name) = requested.filter(|n| !n.trim().is_empty()) else {
            return Ok(best);
        };
        let isa = Isa::parse(name)?;
        if !isa.supported() {
            return Err(KernelError::InvalidArgument(format!(
                "{ISA_ENV}={name}: this CPU cannot run {} (its best path is {})",
                isa.name(),
                best.name()
            )));
        }
        Ok(isa)
    }

    /// The path the kernels use: chosen once per process from the CPU and `AIENG_CPU_ISA`.
    pub fn active() -> Result<Isa, KernelError> {
        static ACTIVE: OnceLock<Result<Isa, KernelError>> = OnceLock::new();
        ACTIVE
            .get_or_init(|| Isa::choose(std::env::var(ISA_ENV).ok().as_deref()))
            .clone()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()).unwrap(), isa);
        }
        assert!(Isa::parse("neon-sve9").is_err());
    }

    #[test]
    fn choose_lowers_but_never_raises() {
        assert_eq!(Isa::choose(None).unwrap(), Isa::best());
        assert_eq!(Isa::choose(Some("scalar")).unwrap(), Isa::Scalar);
        assert_eq!(Isa::choose(Some("")).unwrap(), Isa::best());
        for isa in Isa::ALL {
            assert_eq!(Isa::choose(Some(isa.name())).is_ok(), isa.supported());
        }
    }

    #[test]
    fn scalar_is_always_supported() {
        assert!(Isa::supported_paths().contains(&Isa::Scalar));
        assert!(Isa::best() >= Isa::Scalar);
    }
}
