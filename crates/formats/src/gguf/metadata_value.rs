//! One GGUF metadata value.

use super::cursor::{Cursor, ReadResult};

/// Nesting depth beyond which an array of arrays is rejected, so a crafted
/// file cannot exhaust the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// A metadata value, of any of the 13 GGUF value types.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// An array; GGUF arrays hold elements of one type.
    Array(Vec<MetadataValue>),
}

impl MetadataValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::I8(v) => Some(v.into()),
            MetadataValue::I16(v) => Some(v.into()),
            MetadataValue::I32(v) => Some(v.into()),
            MetadataValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a number of any type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetadataValue::U8(_) => "uint8",
            MetadataValue::I8(_) => "int8",
            MetadataValue::U16(_) => "uint16",
            MetadataValue::I16(_) => "int16",
            MetadataValue::U32(_) => "uint32",
            MetadataValue::I32(_) => "int32",
            MetadataValue::U64(_) => "uint64",
            MetadataValue::I64(_) => "int64",
            MetadataValue::F32(_) => "float32",
            MetadataValue::F64(_) => "float64",
            MetadataValue::Bool(_) => "bool",
            MetadataValue::String(_) => "string",
            MetadataValue::Array(_) => "array",
        }
    }

    /// Reads a value of GGUF type id `type_id`.
    pub(crate) fn read(cursor: &mut Cursor<'_>, type_id: u32, what: &str) -> ReadResult<Self> {
        Self::read_nested(cursor, type_id, what, 0)
    }

    fn read_nested(cursor: &mut Cursor<'_>, type_id: u32, what: &str, depth: usize) -> ReadResult<Self> {
        Ok(match type_id {
            0 => MetadataValue::U8(cursor.u8(what)?),
            1 => MetadataValue::I8(cursor.i8(what)?),
            2 => MetadataValue::U16(cursor.u16(what)?),
            3 => MetadataValue::I16(cursor.i16(what)?),
            4 => MetadataValue::U32(cursor.u32(what)?),
            5 => MetadataValue::I32(cursor.i32(what)?),
            6 => MetadataValue::F32(cursor.f32(what)?),
            7 => {
                let at = cursor.pos();
                match cursor.u8(what)? {
                    0 => MetadataValue::Bool(false),
                    1 => MetadataValue::Bool(true),
                    b => return Err(format!("{what} at offset {at}: bool byte is {b}, expected 0 or 1")),
                }
            }
            8 => MetadataValue::String(cursor.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"));
                }
                let elem_type = cursor.u32(what)?;
                let at = cursor.pos();
                let n = cursor.len(what)?;
                // Every element takes at least one byte (strings and arrays
                // at least 8), so a length past the end of the file is
                // rejected before anything is allocated.
                let min_elem = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                if n.checked_mul(min_elem).is_none_or(|bytes| bytes > cursor.remaining()) {
                    return Err(format!(
                        "{what}: array at offset {at} claims {n} elements, more than the {} bytes left",
                        cursor.remaining()
                    ));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(Self::read_nested(cursor, elem_type, what, depth + 1)?);
                }
                MetadataValue::Array(items)
            }
            10 => MetadataValue::U64(cursor.u64(what)?),
            11 => MetadataValue::I64(cursor.i64(what)?),
            12 => MetadataValue::F64(cursor.f64(what)?),
            other => return Err(format!("{what}: unknown value type {other}")),
        })
    }
}
