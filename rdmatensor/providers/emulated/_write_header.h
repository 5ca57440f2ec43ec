/* What an emulated NIC checks before a write lands, shared by the compiled
 * shm ring (shm/_completion_ring.c) and tcp's inbox (tcp/_inbox.c): the write header both carry,
 * and the check of one against the channel's `local` table (region id ->
 * (arena, key)), as Channel.check_local() does in Python. */
#ifndef RDMATENSOR_WRITE_HEADER_H
#define RDMATENSOR_WRITE_HEADER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#define WRITE_MAGIC 0x52445457u

typedef struct {            /* write_header.py's WRITE_HEADER "<IiIIQQ" (little-endian, as x86-64) */
    uint32_t magic;
    int32_t region;
    uint32_t key;
    uint32_t imm;
    uint64_t offset;
    uint64_t length;
} entry_t;

_Static_assert(sizeof(entry_t) == 32, "a write header is 32 bytes");

/* The (arena, key) pair `local` holds for the entry's region (borrowed), or
 * NULL: not exposed (no error set) or a Python error. */
static PyObject *local_pair(const entry_t *e, PyObject *local) {
    PyObject *id = PyLong_FromLong(e->region);
    if (!id)
        return NULL;
    PyObject *pair = PyDict_GetItemWithError(local, id);
    Py_DECREF(id);
    if (pair && (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)) {
        PyErr_SetString(PyExc_TypeError, "the local regions map region ids to (arena, key)");
        return NULL;
    }
    return pair;
}

/* Whether the entry may land: 1, 0 (refused), -1 (a Python error). */
static int lands(const entry_t *e, PyObject *local) {
    if (e->magic != WRITE_MAGIC)
        return 0;
    if (!e->length)
        return 1;                /* an immediate alone names no region, as in RDMA */
    PyObject *pair = local_pair(e, local);
    if (!pair)
        return PyErr_Occurred() ? -1 : 0;
    unsigned long want = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(pair, 1));
    if (want == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (want != e->key)
        return 0;
    static PyObject *size_name;
    if (!size_name && !(size_name = PyUnicode_InternFromString("size")))
        return -1;
    PyObject *size_obj = PyObject_GetAttr(PyTuple_GET_ITEM(pair, 0), size_name);
    if (!size_obj)
        return -1;
    unsigned long long size = PyLong_AsUnsignedLongLong(size_obj);
    Py_DECREF(size_obj);
    if (size == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return e->length <= size && e->offset <= size - e->length;
}

/* The refused header as the tuple the channel's land() takes apart. */
static PyObject *entry_tuple(const entry_t *e) {
    return Py_BuildValue("(IiIIKK)", e->magic, e->region, e->key, e->imm,
                         (unsigned long long)e->offset, (unsigned long long)e->length);
}

/* Whether event.is_set(): 1, 0, -1 (a Python error). */
static int event_is_set(PyObject *event) {
    static PyObject *is_set_name;
    if (!is_set_name && !(is_set_name = PyUnicode_InternFromString("is_set")))
        return -1;
    PyObject *set = PyObject_CallMethodNoArgs(event, is_set_name);
    if (!set)
        return -1;
    int done = PyObject_IsTrue(set);
    Py_DECREF(set);
    return done;
}

static double monotonic_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#endif
