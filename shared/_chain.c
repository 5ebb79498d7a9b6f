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


/* ------------------------------------------------------------------------ holders
 *
 * Holders: the prefix index's map of block name -> bit mask of the workers holding
 * the block (gateway/placement/prefix_index.py), as one open-addressing table of
 * 24-byte slots (linear probing, deletion by backward shift, at most half full).
 * A walk reads one slot per block, where a dict reads its index, its entry, the key
 * object and the value object: on a 100k-block index that is cold in the cache,
 * the difference is most of what a placement costs. Names are 64-bit (CPython
 * hashes), so this needs a 64-bit build; masks wider than 64 bits (more than 64
 * workers) keep the whole int beside their low 64 bits.
 */
#if SIZEOF_PY_UHASH_T == 8
#define HAVE_HOLDERS 1

typedef struct {
    int64_t key;
    uint64_t low;     /* the mask's low 64 bits */
    PyObject *wide;   /* the whole mask when it has bits above the 64th, else NULL */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t cap;       /* a power of two */
    Py_ssize_t used;
} Holders;

static PyTypeObject HoldersType;

#define MIN_CAP 8
#define M61 ((uint64_t)0x1FFFFFFFFFFFFFFFULL) /* _PyHASH_MODULUS on 64-bit builds */

/* hash(int(value)), as CPython's long_hash computes it */
static inline Py_hash_t
int_hash(int64_t value)
{
    uint64_t magnitude = value < 0 ? (uint64_t)0 - (uint64_t)value : (uint64_t)value;
    Py_hash_t hash = (Py_hash_t)(magnitude % M61);
    if (value < 0) {
        hash = -hash;
    }
    return hash == -1 ? -2 : hash;
}

static inline uint64_t
mix(uint64_t x) /* splitmix64's finalizer: a slot for any key, however regular */
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline int
slot_empty(const Slot *slot)
{
    return slot->low == 0 && slot->wide == NULL;
}

/* the slot holding ``key``, or the empty one where it would go */
static inline Slot *
find(const Holders *self, int64_t key)
{
    size_t last = self->cap - 1;
    size_t i = (size_t)mix((uint64_t)key) & last;
    while (!slot_empty(&self->slots[i]) && self->slots[i].key != key) {
        i = (i + 1) & last;
    }
    return &self->slots[i];
}

static int
resize(Holders *self, size_t cap)
{
    Slot *fresh = PyMem_Calloc(cap, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = self->slots;
    size_t old_cap = self->cap;
    self->slots = fresh;
    self->cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (!slot_empty(&old[i])) {
            *find(self, old[i].key) = old[i];
        }
    }
    PyMem_Free(old);
    return 0;
}

/* empty the slot at ``i``: later slots of its run move back over it */
static void
remove_at(Holders *self, size_t i)
{
    size_t last = self->cap - 1;
    Py_CLEAR(self->slots[i].wide);
    for (size_t j = (i + 1) & last; !slot_empty(&self->slots[j]); j = (j + 1) & last) {
        size_t home = (size_t)mix((uint64_t)self->slots[j].key) & last;
        int between = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!between) { /* its probe passes the hole: it moves there */
            self->slots[i] = self->slots[j];
            i = j;
        }
    }
    self->slots[i] = (Slot){0, 0, NULL};
    self->used--;
}

/* a key as a name: 0 on success; 1 when it cannot be one (not an int in 64 bits: no
 * such key is held), with no exception; -1 with an exception set */
static int
as_key(PyObject *key, int64_t *out)
{
    if (!PyLong_Check(key)) {
        PyErr_Format(PyExc_TypeError, "block names are ints, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(key, &overflow);
    if (overflow) {
        return 1;
    }
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)value;
    return 0;
}

static PyObject *
slot_value(const Slot *slot)
{
    if (slot->wide != NULL) {
        return Py_NewRef(slot->wide);
    }
    return PyLong_FromUnsignedLongLong(slot->low);
}

static PyObject *
holders_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Holders() takes no arguments");
        return NULL;
    }
    Holders *self = (Holders *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->slots = PyMem_Calloc(MIN_CAP, sizeof(Slot));
    if (self->slots == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->cap = MIN_CAP;
    self->used = 0;
    return (PyObject *)self;
}

static void
holders_dealloc(Holders *self)
{
    if (self->slots != NULL) {
        for (size_t i = 0; i < self->cap; i++) {
            Py_XDECREF(self->slots[i].wide);
        }
        PyMem_Free(self->slots);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
holders_len(Holders *self)
{
    return self->used;
}

static PyObject *
holders_subscript(Holders *self, PyObject *key)
{
    int64_t name;
    int found = as_key(key, &name);
    if (found < 0) {
        return NULL;
    }
    Slot *slot = found == 0 ? find(self, name) : NULL;
    if (slot == NULL || slot_empty(slot)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return slot_value(slot);
}

static int
holders_store(Holders *self, int64_t name, PyObject *value)
{
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "masks are ints, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (small == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow < 0 || (overflow == 0 && small <= 0)) {
        PyErr_SetString(PyExc_ValueError, "a mask is positive (delete a block no worker holds)");
        return -1;
    }
    uint64_t low = PyLong_AsUnsignedLongLongMask(value);
    if (low == (uint64_t)-1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *wide = NULL;
    if (overflow > 0 && PyLong_AsUnsignedLongLong(value) == (unsigned long long)-1 &&
        PyErr_Occurred()) { /* past 64 bits: the whole int is kept */
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        wide = Py_NewRef(value);
    }
    Slot *slot = find(self, name);
    if (slot_empty(slot)) {
        if ((size_t)(self->used + 1) * 2 > self->cap) {
            if (resize(self, self->cap * 2) < 0) {
                Py_XDECREF(wide);
                return -1;
            }
            slot = find(self, name);
        }
        self->used++;
    }
    PyObject *old = slot->wide;
    *slot = (Slot){name, low, wide};
    Py_XDECREF(old);
    return 0;
}

static int
holders_ass_subscript(Holders *self, PyObject *key, PyObject *value)
{
    int64_t name;
    int found = as_key(key, &name);
    if (found < 0) {
        return -1;
    }
    if (value != NULL) {
        if (found == 1) {
            PyErr_SetString(PyExc_OverflowError, "block names fit in 64 bits");
            return -1;
        }
        return holders_store(self, name, value);
    }
    Slot *slot = found == 0 ? find(self, name) : NULL;
    if (slot == NULL || slot_empty(slot)) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    remove_at(self, (size_t)(slot - self->slots));
    return 0;
}

static int
holders_contains(Holders *self, PyObject *key)
{
    int64_t name;
    int found = as_key(key, &name);
    if (found != 0) {
        return found < 0 ? -1 : 0;
    }
    return !slot_empty(find(self, name));
}

static PyObject *
holders_get(Holders *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *fallback = nargs == 2 ? args[1] : Py_None;
    int64_t name;
    int found = as_key(args[0], &name);
    if (found < 0) {
        return NULL;
    }
    Slot *slot = found == 0 ? find(self, name) : NULL;
    if (slot == NULL || slot_empty(slot)) {
        return Py_NewRef(fallback);
    }
    return slot_value(slot);
}

static PyObject *
holders_items(Holders *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *items = PyList_New(0);
    if (items == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < self->cap; i++) {
        Slot *slot = &self->slots[i];
        if (slot_empty(slot)) {
            continue;
        }
        PyObject *value = slot_value(slot);
        PyObject *pair = value == NULL ? NULL : Py_BuildValue("(LN)", (long long)slot->key, value);
        if (pair == NULL || PyList_Append(items, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(items);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return items;
}

static PyMappingMethods holders_mapping = {
    .mp_length = (lenfunc)holders_len,
    .mp_subscript = (binaryfunc)holders_subscript,
    .mp_ass_subscript = (objobjargproc)holders_ass_subscript,
};

static PySequenceMethods holders_sequence = {
    .sq_contains = (objobjproc)holders_contains,
};

static PyMethodDef holders_methods[] = {
    {"get", (PyCFunction)(void (*)(void))holders_get, METH_FASTCALL,
     "get(name, default=None): the mask of the workers holding block ``name``."},
    {"items", (PyCFunction)holders_items, METH_NOARGS,
     "items() -> list[tuple[int, int]]: every (name, mask), in no order."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HoldersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shared._chain.Holders",
    .tp_doc = "Block name -> bit mask of the workers holding it (ints; masks positive).",
    .tp_basicsize = sizeof(Holders),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = holders_new,
    .tp_dealloc = (destructor)holders_dealloc,
    .tp_as_mapping = &holders_mapping,
    .tp_as_sequence = &holders_sequence,
    .tp_methods = holders_methods,
};

#define AHEAD 16 /* names computed, and their slots fetched, before the first is read */

/* walk_chain over Holders: the same steps, one slot read per block */
static int
walk_holders(PyObject **items, Py_ssize_t size, Py_ssize_t count, Py_hash_t name_hash,
             const Holders *holders, unsigned long long held, PyObject *out)
{
    int64_t names[AHEAD];
    size_t last = holders->cap - 1;
    Py_ssize_t depth = 0;
    while (depth < count && held) {
        Py_ssize_t ahead = count - depth < AHEAD ? count - depth : AHEAD;
        for (Py_ssize_t k = 0; k < ahead; k++) {
            Py_hash_t block = block_hash(items + (depth + k) * size, size);
            if (block == -1) {
                return -1;
            }
            Py_uhash_t acc = XXPRIME_5;
            ADD_LANE(acc, (Py_uhash_t)name_hash);
            ADD_LANE(acc, (Py_uhash_t)block);
            names[k] = (int64_t)finish(acc, 2);
            name_hash = int_hash(names[k]);
#if defined(__GNUC__)
            __builtin_prefetch(&holders->slots[(size_t)mix((uint64_t)names[k]) & last]);
#endif
        }
        for (Py_ssize_t k = 0; k < ahead && held; k++, depth++) {
            unsigned long long now = find(holders, names[k])->low & held;
            if (now != held) {
                if (record(out, depth, held & ~now) < 0) {
                    return -1;
                }
                held = now;
            }
        }
    }
    if (held && record(out, depth, held) < 0) {
        return -1;
    }
    return 0;
}
#endif /* SIZEOF_PY_UHASH_T == 8 */

static PyObject *
walk_chain(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *tokens, *name, *holders;
    Py_ssize_t size, count;
    unsigned long long held;
    if (!PyArg_ParseTuple(args, "OnnOOK:walk_chain", &tokens, &size, &count, &name, &holders,
                          &held)) {
        return NULL;
    }
    int table = 0;
#ifdef HAVE_HOLDERS
    table = Py_IS_TYPE(holders, &HoldersType);
#endif
    if (!table && !PyDict_CheckExact(holders)) {
        PyErr_SetString(PyExc_TypeError, "holders must be a dict or a Holders");
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
#ifdef HAVE_HOLDERS
    if (table) {
        if (walk_holders(items, size, count, name_hash, (Holders *)holders, held, out) < 0) {
            goto fail;
        }
        Py_DECREF(fast);
        return out;
    }
#endif
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
    PyObject *created = PyModule_Create(&module);
#ifdef HAVE_HOLDERS
    if (created != NULL && (PyType_Ready(&HoldersType) < 0 ||
                            PyModule_AddObjectRef(created, "Holders", (PyObject *)&HoldersType) < 0)) {
        Py_CLEAR(created);
    }
#endif
    return created;
}
