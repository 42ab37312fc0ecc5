//! PTX built from `cuda/*.cu` (cuda feature only) and launch helpers shared by the ops.

#[cfg(feature = "cuda")]
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

#[cfg(feature = "cuda")]
pub use cuda::*;

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{Layout, Result};

    /// The contiguous view of `storage` that `layout` describes, or an error naming `what`.
    pub fn contiguous_view<'a, T: CudaDType + DeviceRepr>(
        storage: &'a CudaStorage,
        layout: &Layout,
        what: &str,
    ) -> Result<CudaView<'a, T>> {
        let slice: &CudaSlice<T> = storage.as_cuda_slice::<T>()?;
        match layout.contiguous_offsets() {
            Some((start, end)) => Ok(slice.slice(start..end)),
            None => candle_core::bail!("{what} must be contiguous, got layout {layout:?}"),
        }
    }

    /// Map a cudarc driver error into a candle error.
    pub fn launch_err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
        candle_core::Error::wrap(e)
    }
}
