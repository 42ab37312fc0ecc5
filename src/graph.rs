//! Batch-size-specific decode steps replayed as CUDA graphs.
//!
//! Stock candle's batch-1 decode is bound by host work per op. A [`GraphDecoder`] captures
//! the whole decode step of our Llama once (cudarc stream capture on candle's stream) and
//! replays it: one graph launch per token. Every launch in the step reads its inputs from
//! device buffers owned here or by the cache (token ids, position, padding, KV storage), and
//! the position advances on the device inside the graph, so the replay is valid step after
//! step. Where capture is not possible (CPU, event tracking on, a format whose kernels
//! upload host data per call), the same step runs eagerly and the decoder says why, once.

use crate::llama::{Cache, Llama};
use candle_core::{DType, Device, Result, Tensor};

/// How the decoder runs its steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Not yet decided: the first step runs eagerly (so workspaces that candle and cuBLAS
    /// grow on first use at this batch size are allocated outside capture), the second is
    /// captured.
    Pending,
    /// Replaying a captured CUDA graph.
    Graph,
    /// Eager execution, with the reason capture was not used.
    Eager(String),
}

/// Decode steps for one batch size over one model and cache.
pub struct GraphDecoder {
    batch: usize,
    ids: Tensor,
    pos: Tensor,
    logits: Tensor,
    /// Host copy of what `pos` holds on the device, if known.
    dev_pos: Option<usize>,
    mode: Mode,
    #[cfg(feature = "cuda")]
    captured_generation: u64,
    /// Whether one eager step has run (capture waits for it).
    #[cfg(feature = "cuda")]
    warmed: bool,
    #[cfg(feature = "cuda")]
    graph: Option<candle_core::cuda_backend::cudarc::driver::CudaGraph>,
}

impl GraphDecoder {
    /// A decoder for `batch` sequences of `model` (device buffers allocated now).
    pub fn new(model: &Llama, batch: usize, device: &Device) -> Result<Self> {
        if batch == 0 {
            candle_core::bail!("graph decoder: batch must be at least 1")
        }
        let vocab = model.vocab_size();
        print_path_notes(model, device);
        Ok(Self {
            batch,
            ids: Tensor::zeros(batch, DType::U32, device)?,
            pos: Tensor::zeros(1, DType::U32, device)?,
            logits: Tensor::zeros((batch, vocab), DType::F32, device)?,
            dev_pos: None,
            mode: Mode::Pending,
            #[cfg(feature = "cuda")]
            captured_generation: 0,
            #[cfg(feature = "cuda")]
            warmed: false,
            #[cfg(feature = "cuda")]
            graph: None,
        })
    }

    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// One decode step: `tokens[i]` of sequence `i` sits at position `pos` (after a
    /// prefill of `pos` tokens through [`Llama::forward`] on the same cache). Returns f32
    /// logits `[batch, vocab]` — the decoder's own buffer, overwritten by the next step.
    pub fn step(
        &mut self,
        model: &Llama,
        cache: &mut Cache,
        tokens: &[u32],
        pos: usize,
    ) -> Result<Tensor> {
        if tokens.len() != self.batch {
            candle_core::bail!(
                "graph decoder: {} tokens for batch {}",
                tokens.len(),
                self.batch
            )
        }
        if cache.batch() != self.batch || pos == 0 {
            candle_core::bail!(
                "graph decoder: prefill the cache for batch {} first (cache batch {}, position {pos})",
                self.batch,
                cache.batch()
            )
        }
        if pos + 1 > cache.max_len() {
            candle_core::bail!(
                "decode: position {pos} is past the context of {} tokens",
                cache.max_len()
            )
        }
        let vocab = model.vocab_size();
        for &t in tokens {
            if t as usize >= vocab {
                candle_core::bail!("decode: token id {t} out of range (vocab {vocab})")
            }
        }
        let dev = self.ids.device().clone();
        self.ids.slice_set(&Tensor::new(tokens, &dev)?, 0, 0)?;
        if self.dev_pos != Some(pos) {
            self.pos
                .slice_set(&Tensor::new(&[pos as u32], &dev)?, 0, 0)?;
        }
        self.run(model, cache, pos)?;
        self.dev_pos = Some(pos + 1);
        Ok(self.logits.clone())
    }

    fn eager(&mut self, model: &Llama, cache: &mut Cache, pos: usize) -> Result<()> {
        model.decode_step_into(&self.ids, &self.pos, pos, &self.logits, cache)
    }

    #[cfg(not(feature = "cuda"))]
    fn run(&mut self, model: &Llama, cache: &mut Cache, pos: usize) -> Result<()> {
        if self.mode == Mode::Pending {
            self.mode = Mode::Eager("built without the cuda feature".into());
        }
        self.eager(model, cache, pos)
    }

    #[cfg(feature = "cuda")]
    fn run(&mut self, model: &Llama, cache: &mut Cache, pos: usize) -> Result<()> {
        if self.mode == Mode::Graph && self.captured_generation != cache.generation {
            self.graph = None;
            self.mode = Mode::Pending;
        }
        if self.mode == Mode::Pending && !self.warmed {
            // E.g. candle's quantized matmul grows a process-wide activation workspace the
            // first time it sees a larger batch; growing it inside a capture frees the old
            // buffer there, which the driver refuses (CUDA_ERROR_INVALID_VALUE).
            self.warmed = true;
            return self.eager(model, cache, pos);
        }
        if self.mode == Mode::Pending {
            if let Err(why) = self.capture(model, cache, pos) {
                eprintln!("note: decoding without CUDA graph replay: {why}");
                self.mode = Mode::Eager(why);
            }
        }
        match (&self.mode, &self.graph) {
            (Mode::Graph, Some(g)) => g.launch().map_err(candle_core::Error::wrap),
            _ => self.eager(model, cache, pos),
        }
    }

    /// Capture one step into a graph (nothing runs during capture). Err(reason) where it
    /// cannot be done; the step then runs eagerly.
    #[cfg(feature = "cuda")]
    fn capture(
        &mut self,
        model: &Llama,
        cache: &mut Cache,
        pos: usize,
    ) -> std::result::Result<(), String> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let Device::Cuda(cuda) = self.ids.device().clone() else {
            return Err("the model is not on a CUDA device".into());
        };
        if cuda.is_event_tracking() {
            return Err(
                "event tracking is on: create the device with candle_lowbit::graph::cuda_device"
                    .into(),
            );
        }
        model.graph_ready(cache)?;
        let stream = cuda.cuda_stream();
        let _htod = cuda.enable_cuda_graph_htod_cache();
        stream.synchronize().map_err(|e| e.to_string())?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| e.to_string())?;
        let body = model.decode_step_into(&self.ids, &self.pos, pos, &self.logits, cache);
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let graph = stream.end_capture(flags);
        body.map_err(|e| format!("capture failed: {e}"))?;
        match graph {
            Ok(Some(g)) => {
                self.graph = Some(g);
                self.mode = Mode::Graph;
                self.captured_generation = cache.generation;
                Ok(())
            }
            Ok(None) => Err("stream capture produced no graph".into()),
            Err(e) => Err(format!("stream capture failed: {e}")),
        }
    }
}

/// The fused paths the model's layers do not take on the GPU, and why: each distinct
/// note once per process.
fn print_path_notes(model: &Llama, device: &Device) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    if !device.is_cuda() {
        return;
    }
    let Ok(mut seen) = SEEN.lock() else { return };
    for note in model.path_notes() {
        if !seen.contains(&note) {
            eprintln!("note: decode path: {note}");
            seen.push(note);
        }
    }
}

/// A CUDA device set up for graph capture (event tracking off: candle then uses its one
/// stream without per-tensor events, which stream capture cannot record). Use it for
/// every tensor of the model and cache. Falls back to the CPU only if `ordinal` is `None`.
#[cfg(feature = "cuda")]
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    let dev = candle_core::CudaDevice::new_with_stream(ordinal)?;
    let dev = Device::Cuda(dev);
    if let Device::Cuda(c) = &dev {
        // Safety: all our work runs on the device's one stream.
        unsafe { c.disable_event_tracking() };
    }
    Ok(dev)
}

/// The device the examples and benches run on: the graph-ready CUDA device 0 where the
/// crate is built with `cuda` and a GPU is present (unless `cpu`), else the CPU.
pub fn default_device(cpu: bool) -> Result<Device> {
    #[cfg(feature = "cuda")]
    if !cpu && candle_core::utils::cuda_is_available() {
        return cuda_device(0);
    }
    let _ = cpu;
    Ok(Device::Cpu)
}
