//! `oversize_text` for Python: the body is parsed with the GIL released.

use pyo3::prelude::*;

/// (model, index, size) of the first text of `field` past `limit` bytes, or None.
#[pyfunction]
fn oversize_text(
    py: Python<'_>,
    body: &[u8],
    field: &str,
    limit: usize,
) -> Option<(Option<String>, Option<usize>, usize)> {
    let found = py.detach(|| super::oversize_text(body, field, limit))?;
    Some((found.model, found.index, found.size))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(oversize_text, m)?)
}
