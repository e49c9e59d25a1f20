//! A bounds-checked little-endian reader over the bytes of a GGUF file.

/// Reads primitive values front to back; every read checks that the bytes
/// are there. Errors are plain messages that name the byte offset; the
/// caller wraps them with the file's path.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

pub(crate) type ReadResult<T> = std::result::Result<T, String>;

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// The offset of the next byte to read.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left after the current position.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes, or an error naming `what` if the file ends first.
    pub(crate) fn take(&mut self, n: usize, what: &str) -> ReadResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!("file ends while reading {what} at offset {} (needs {n} bytes, {} left)", self.pos, self.remaining()));
        }
        let slice = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> ReadResult<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &str) -> ReadResult<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    pub(crate) fn i8(&mut self, what: &str) -> ReadResult<i8> {
        Ok(i8::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u16(&mut self, what: &str) -> ReadResult<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn i16(&mut self, what: &str) -> ReadResult<i16> {
        Ok(i16::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u32(&mut self, what: &str) -> ReadResult<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn i32(&mut self, what: &str) -> ReadResult<i32> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u64(&mut self, what: &str) -> ReadResult<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn i64(&mut self, what: &str) -> ReadResult<i64> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn f32(&mut self, what: &str) -> ReadResult<f32> {
        Ok(f32::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn f64(&mut self, what: &str) -> ReadResult<f64> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }

    /// A length (u64 in GGUF v2/v3) that must fit in memory.
    pub(crate) fn len(&mut self, what: &str) -> ReadResult<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| format!("{what} at offset {at} is {n}, too large"))
    }

    /// A GGUF string: u64 byte length then UTF-8 bytes.
    pub(crate) fn string(&mut self, what: &str) -> ReadResult<String> {
        let at = self.pos;
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("{what} at offset {at} is not UTF-8: {e}"))
    }
}
