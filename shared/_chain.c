/* Conveyor's block names, in C: the request path names every prompt block it places.
 *
 * chain_names(token_ids, block_size, start, count, name) returns the names of blocks
 * start .. start + count - 1 of token_ids, chained from ``name`` (the name of the block
 * before ``start``, or the chain's seed), exactly as the reference in
 * shared/block_hashes.py computes them: name = hash((name, tuple(block))). It repeats
 * CPython's tuple hash (Objects/tupleobject.c, xxHash-based, unchanged since 3.8) over
 * PyObject_Hash of each token, so it builds no tuple at all.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if SIZEOF_PY_UHASH_T > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) ((x << 13) | (x >> 19))
#endif

#define ADD_LANE(acc, lane)            \
    do {                               \
        (acc) += (lane) * XXPRIME_2;   \
        (acc) = XXROTATE(acc);         \
        (acc) *= XXPRIME_1;            \
    } while (0)

static Py_hash_t
finish(Py_uhash_t acc, Py_ssize_t len)
{
    acc += (Py_uhash_t)len ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) {
        return 1546275796;
    }
    return (Py_hash_t)acc;
}

/* hash(item): token ids are small ints, whose hash is their value (read here without
 * a call); anything else goes through PyObject_Hash */
static inline Py_hash_t
token_hash(PyObject *item)
{
    if (PyLong_CheckExact(item)) {
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
            Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)item);
            return value == -1 ? -2 : (Py_hash_t)value;
        }
#else
        Py_ssize_t digits = Py_SIZE(item);
        if (digits == 0) {
            return 0;
        }
        if (digits == 1) {
            return (Py_hash_t)((PyLongObject *)item)->ob_digit[0];
        }
#endif
    }
    return PyObject_Hash(item);
}

/* hash(tuple(items[0:size])); -1 with an exception set on failure */
static Py_hash_t
block_hash(PyObject **items, Py_ssize_t size)
{
    Py_uhash_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < size; i++) {
        Py_uhash_t lane = (Py_uhash_t)token_hash(items[i]);
        if (lane == (Py_uhash_t)-1) {
            return -1;
        }
        ADD_LANE(acc, lane);
    }
    return finish(acc, size);
}

/* The name of the block at ``items`` after the block whose name hashes to *name_hash
 * (hash((name, block))), a new reference; *name_hash becomes its hash. NULL on error. */
static PyObject *
next_name(PyObject **items, Py_ssize_t size, Py_hash_t *name_hash)
{
    Py_hash_t block = block_hash(items, size);
    if (block == -1) {
        return NULL;
    }
    Py_uhash_t acc = XXPRIME_5;
    ADD_LANE(acc, (Py_uhash_t)*name_hash);
    ADD_LANE(acc, (Py_uhash_t)block);
    PyObject *name = PyLong_FromSsize_t(finish(acc, 2));
    if (name == NULL) {
        return NULL;
    }
    *name_hash = PyObject_Hash(name);
    if (*name_hash == -1) {
        Py_DECREF(name);
        return NULL;
    }
    return name;
}

static PyObject *
chain_names(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *tokens, *name;
    Py_ssize_t size, start, count;
    if (!PyArg_ParseTuple(args, "OnnnO:chain_names", &tokens, &size, &start, &count, &name)) {
        return NULL;
    }
    if (size <= 0 || start < 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive, start and count not negative");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(tokens, "token_ids must be a list or a tuple");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t blocks = PySequence_Fast_GET_SIZE(fast) / size;
    if (start > blocks || count > blocks - start) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "token_ids hold fewer full blocks than asked for");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast) + start * size;
    Py_hash_t name_hash = PyObject_Hash(name);
    PyObject *names = name_hash == -1 ? NULL : PyList_New(count);
    if (names == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *next = next_name(items + i * size, size, &name_hash);
        if (next == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(names, i, next);
    }
    Py_DECREF(fast);
    return names;
fail:
    Py_DECREF(fast);
    Py_XDECREF(names);
    return NULL;
}


/* append (depth, dropped) to ``out``; 0 on success */
static int
record(PyObject *out, Py_ssize_t depth, unsigned long long dropped)
{
    PyObject *pair = Py_BuildValue("(nK)", depth, dropped);
    if (pair == NULL) {
        return -1;
    }
    int failed = PyList_Append(out, pair);
    Py_DECREF(pair);
    return failed;
}

static PyObject *
walk_chain(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *tokens, *name, *holders;
    Py_ssize_t size, count;
    unsigned long long held;
    if (!PyArg_ParseTuple(args, "OnnOO!K:walk_chain", &tokens, &size, &count, &name,
                          &PyDict_Type, &holders, &held)) {
        return NULL;
    }
    if (size <= 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive, count not negative");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(tokens, "token_ids must be a list or a tuple");
    if (fast == NULL) {
        return NULL;
    }
    if (count > PySequence_Fast_GET_SIZE(fast) / size) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "token_ids hold fewer full blocks than asked for");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_hash_t name_hash = PyObject_Hash(name);
    PyObject *out = name_hash == -1 ? NULL : PyList_New(0);
    if (out == NULL) {
        goto fail;
    }
    Py_ssize_t depth = 0;
    for (; depth < count && held; depth++) {
        PyObject *next = next_name(items + depth * size, size, &name_hash);
        if (next == NULL) {
            goto fail;
        }
        PyObject *mask = PyDict_GetItemWithError(holders, next); /* borrowed */
        Py_DECREF(next);
        if (mask == NULL && PyErr_Occurred()) {
            goto fail;
        }
        /* held fits in 64 bits, so only a mask's low 64 bits can meet it */
        unsigned long long now = mask == NULL ? 0 : PyLong_AsUnsignedLongLongMask(mask);
        if (now == (unsigned long long)-1 && PyErr_Occurred()) {
            goto fail;
        }
        now &= held;
        if (now != held) {
            if (record(out, depth, held & ~now) < 0) {
                goto fail;
            }
            held = now;
        }
    }
    if (held && record(out, depth, held) < 0) {
        goto fail;
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_names", chain_names, METH_VARARGS,
     "chain_names(token_ids, block_size, start, count, name) -> list[int]: the names of "
     "blocks start .. start + count - 1, chained from name (see shared/block_hashes.py)."},
    {"walk_chain", walk_chain, METH_VARARGS,
     "walk_chain(token_ids, block_size, count, seed, holders, held) -> list[tuple[int, int]]: "
     "names the first count blocks from seed while holders[name] & held keeps some of held "
     "(held: a 64-bit mask); each (depth, dropped) says which bits of held stopped holding "
     "at that depth (see shared/block_hashes.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_chain",
    .m_doc = "Conveyor's block names, in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    return PyModule_Create(&module);
}
